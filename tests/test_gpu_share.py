"""The harness that lets pytest workers share one GPU (tests/gpu_share/sitecustomize.py): with
MINIVLLM_TEST_GPU_SHARE set, every Python process started with that folder on its path sees the share
as the card's total memory; without it, nothing changes. (On a CPU torch.cuda.mem_get_info cannot run,
so this checks the wrapping and the arithmetic, with the real function stood in for.)"""
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
