"""The harness that lets pytest workers share one GPU (tests/gpu_share/sitecustomize.py): with
MINIVLLM_TEST_GPU_SHARE set, every Python process started with that folder on its path sees the share
as the card's total memory; without it, nothing changes. (On a CPU torch.cuda.mem_get_info cannot run,
so this checks the wrapping and the arithmetic, with the real function stood in for.) And the script of a
GPU lease's measurements, scripts/gpu_figures.sh."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import torch
print(torch.cuda.mem_get_info.__name__)
if torch.cuda.mem_get_info.__name__ == "_shared_mem_get_info":
    import sitecustomize
    sitecustomize._mem_get_info = lambda device=None: (30 * 2**30, 80 * 2**30)  # a stand-in card
    print(*torch.cuda.mem_get_info())
"""


def probe(share: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_TEST_GPU_SHARE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "gpu_share")])
    if share is not None:
        env["MINIVLLM_TEST_GPU_SHARE"] = share
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_a_share_scales_the_total_and_keeps_the_free_memory():
    name, free, total = probe("0.25")
    assert name == "_shared_mem_get_info"
    assert int(free) == 30 * 2**30 and int(total) == 20 * 2**30


def test_without_a_share_nothing_is_wrapped():
    assert probe(None) == ["mem_get_info"]
    assert probe("0") == ["mem_get_info"]


def test_gpu_figures_script_parses_and_refuses_an_unknown_step():
    """scripts/gpu_figures.sh (a GPU lease's measurement run) is valid bash and names its steps on a typo,
    before it makes a model or starts a benchmark."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_figures.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "ONLY": "ladder latnecy"}, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "unknown step 'latnecy'" in proc.stdout
