"""Shared test set-up: the Triton interpreter on CPU, and small model checkpoints made once per run."""
import os


def _pin_worker_to_one_gpu():
    """`make test` on a host with k > 1 GPUs runs k pytest-xdist workers and sets MINIVLLM_TEST_GPUS=k:
    worker gwN sees GPU N % k alone, as every engine sizes its KV cache from one GPU's free memory.
    Must run before CUDA is first touched (torch.cuda.is_available below)."""
    num_gpus = int(os.environ.get("MINIVLLM_TEST_GPUS", "0") or 0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if num_gpus > 1 and worker.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % num_gpus)


_pin_worker_to_one_gpu()

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must be set before triton is first imported: kernels run in the interpreter on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


_exercise_lines: list[str] = []


def pytest_configure(config):
    """Under pytest-xdist, share the cores between the workers: torch's default pool in every worker
    spans all cores, and N workers x all cores threads wait on each other at every op's barrier.
    (Notebook kernels get one thread: tests/test_notebooks.py.)
    With MINIVLLM_EXERCISE set, the tests grade the learner's functions (chapters/exercises/)."""
    from chapters.exercises.grading import install_from_environment

    _exercise_lines[:] = install_from_environment()
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        num_threads = max(1, num_cores // num_workers)
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # for the processes tests start (benchmarks)


def pytest_report_header(config):
    return _exercise_lines or None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """An exercise not written yet fails with its own message (which exercise, what to read) instead
    of a long traceback through the kernel or the engine."""
    outcome = yield
    if _exercise_lines and call.excinfo is not None:
        from chapters.exercises.grading import unwritten_exercise_message

        message = unwritten_exercise_message(call.excinfo.value)
        if message is not None:
            outcome.get_result().longrepr = message


def pytest_runtest_logreport(report):
    """MINIVLLM_TEST_LOG=FILE: a line per test as it ends (outcome, phase, seconds, node id), and a
    failure's traceback at once, so that a run cut short by a time limit still tells what ran, how long
    each test took and what failed. Written by the controller only under xdist."""
    path = os.environ.get("MINIVLLM_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.passed and report.when != "call"):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.when} {report.duration:.2f} {report.nodeid}\n")
        if report.failed:
            f.write(report.longreprtext + "\n")


def finished_in_log(path: str) -> set[str]:
    """The node ids a MINIVLLM_TEST_LOG file records an outcome for (passed, skipped or failed)."""
    finished = set()
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split(" ", 3)
            if len(fields) == 4 and fields[0] in ("PASSED", "SKIPPED", "FAILED") and fields[1] in ("setup", "call"):
                finished.add(fields[3])
    return finished


def pytest_collection_modifyitems(config, items):
    """MINIVLLM_TEST_RESUME=1 with MINIVLLM_TEST_LOG: leave out the tests the log already has an outcome
    for, so that a run cut short by a time limit goes on where it stopped (failures are left for
    `--lf`). GPU-only tests skip without CUDA. With MINIVLLM_TEST_GPU_SHARE (tests/gpu_share/sitecustomize.py:
    workers sharing one GPU) the tests that size engines from the whole card's memory, or need more of it
    than a share, wait for a run of their own (`-m whole_gpu`)."""
    log = os.environ.get("MINIVLLM_TEST_LOG")
    if os.environ.get("MINIVLLM_TEST_RESUME") == "1" and log and os.path.exists(log):
        finished = finished_in_log(log)
        done = [item for item in items if item.nodeid in finished]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if item.nodeid not in finished]
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA (GPU-only test)")
    if float(os.environ.get("MINIVLLM_TEST_GPU_SHARE", "0") or 0) > 0:
        skips["whole_gpu"] = pytest.mark.skip(
            reason="needs the whole card: run alone (-m whole_gpu) without MINIVLLM_TEST_GPU_SHARE")
    for item in items:
        for keyword, skip in skips.items():
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test draws the same random tensors whatever ran before it (xdist spreads tests over
    workers in a different order each run), so a tolerance that holds once holds every time."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def qwen3_tiny_dir(tmp_path_factory):
    from minivllm.tools.make_model import make_model

    return str(make_model("qwen3-tiny", tmp_path_factory.mktemp("ckpt") / "qwen3-tiny", seed=0))


@pytest.fixture(scope="session")
def llama_tiny_dir(tmp_path_factory):
    from minivllm.tools.make_model import make_model

    return str(make_model("llama-tiny", tmp_path_factory.mktemp("ckpt") / "llama-tiny", seed=0))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct, converted once into $MINIVLLM_CACHE (or ~/.cache/minivllm) and reused."""
    from minivllm.tools.smollm2 import get_smollm2

    try:
        return get_smollm2()
    except ImportError as e:  # no gguf package (e.g. the GPU machine) and nothing converted yet
        pytest.skip(str(e))


@pytest.fixture
def kernel_device(monkeypatch):
    """A device whose draws the Triton sampling kernel makes: CUDA, or the CPU through the interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    from minivllm.engine import sampler

    monkeypatch.setattr(sampler, "uses_kernel_draw", lambda device: True)
    return "cpu"
