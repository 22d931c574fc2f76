"""Every course notebook (notebooks/*.ipynb) executes headless, top to bottom, without an error.

One test per notebook, so a notebook added by a later chapter is picked up by the glob. Each runs
in a fresh "python3" kernel with the notebooks folder as its working directory and a temporary
directory of its own (TMPDIR), which must be empty when the notebook ends: a notebook cleans up what
it makes. The private TMPDIR also keeps notebooks that run at once (pytest-xdist) apart.
"""
import os
from pathlib import Path

import pytest
import torch

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
# Caches that libraries keep in the temporary directory on purpose (torch.compile's, on a GPU).
LIBRARY_CACHE_PREFIXES = ("torchinductor_",)


def _kernel_environment(monkeypatch, tmpdir: Path):
    """The kernel inherits os.environ when it starts, so set what it needs there."""
    # This checkout's package, not whichever copy is installed in the environment.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(NOTEBOOK_DIR.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # tempfile.mkdtemp() in the notebook lands here
    if not torch.cuda.is_available():
        # Later chapters run Triton kernels; without CUDA they must run in Triton's interpreter,
        # which has to be chosen before triton is first imported in the kernel.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        # The notebooks' tiny models gain nothing from intra-op threads, and on a CPU shared with other
        # tests a thread pool turns every small op into a wait on a barrier (measured on a loaded 2-core
        # machine: a [8, 1, 40] softmax took 2 us with one thread and 10 ms with two).
        monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[notebooks]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[notebooks]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[notebooks]')")
    kernel_tmp = tmp_path / "tmp"
    kernel_tmp.mkdir()
    _kernel_environment(monkeypatch, kernel_tmp)
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError naming the failing cell, with its traceback
    left = sorted(p.name for p in kernel_tmp.iterdir() if not p.name.startswith(LIBRARY_CACHE_PREFIXES))
    assert not left, f"{path.name} left temporary files behind: {left}"


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[notebooks]')")
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        with_outputs = [i for i, cell in enumerate(notebook.cells)
                        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))]
        assert not with_outputs, f"{path.name}: cells {with_outputs} have outputs; clear them before committing"
