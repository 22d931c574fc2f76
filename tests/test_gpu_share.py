"""The harness that lets pytest workers share one GPU (tests/gpu_share/sitecustomize.py): with
MINIVLLM_TEST_GPU_SHARE set, every Python process started with that folder on its path sees the share
as the card's total memory, and the share less its own allocator's memory as free; without it, nothing
changes. (On a CPU torch.cuda.mem_get_info cannot run, so this checks the wrapping and the arithmetic,
with the real functions stood in for.) And the script of a
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
    for card_free, own in ((30, 0), (30, 5), (10, 0), (30, 25)):  # GiB: the card's free memory, this process's
        sitecustomize._mem_get_info = lambda device=None: (card_free * 2**30, 80 * 2**30)  # a stand-in card
        torch.cuda.memory_reserved = lambda device=None: own * 2**30
        print(*(n // 2**30 for n in torch.cuda.mem_get_info()))
"""


def probe(share: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_TEST_GPU_SHARE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "gpu_share")])
    if share is not None:
        env["MINIVLLM_TEST_GPU_SHARE"] = share
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_a_share_is_a_card_of_its_own():
    """A quarter of an 80 GiB card: 20 GiB total; free is the share less what this process holds (other
    workers' allocations do not count), but never more than the card has free."""
    name, *figures = probe("0.25")
    assert name == "_shared_mem_get_info"
    free_total = [tuple(map(int, figures[i:i + 2])) for i in range(0, len(figures), 2)]
    assert free_total == [(20, 20), (15, 20), (10, 20), (0, 20)]


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


def test_a_resumed_run_leaves_out_what_the_log_finished(tmp_path):
    """MINIVLLM_TEST_RESUME=1 (a shared GPU run cut by a time limit, run again): the tests the log has an
    outcome for are left out, a failure included (the rerun's --lf takes those); the others run and
    append to the same log."""
    log = tmp_path / "log.txt"
    ids = [f"tests/test_gpu_share.py::{name}" for name in
           ("test_a_share_is_a_card_of_its_own", "test_without_a_share_nothing_is_wrapped",
            "test_gpu_figures_script_parses_and_refuses_an_unknown_step")]
    log.write_text(f"PASSED call 1.00 {ids[0]}\nFAILED call 1.00 {ids[1]}\nE   a traceback line\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # (its own controller)
    env.update(MINIVLLM_TEST_LOG=str(log), MINIVLLM_TEST_RESUME="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 passed, 2 deselected" in proc.stdout
    assert log.read_text().splitlines()[-1].split(" ", 3)[::3] == ["PASSED", ids[2]]
