"""Every course notebook (notebooks/*.ipynb) executes headless, top to bottom, without an error, and is
committed with its outputs, clean of anything that belongs to the machine that ran it.

One test per notebook, so a notebook added by a later chapter is picked up by the glob. Each runs
in a fresh "python3" kernel with the notebooks folder as its working directory and a temporary
directory of its own (TMPDIR), which must be empty when the notebook ends: a notebook cleans up what
it makes. The private TMPDIR also keeps notebooks that run at once (pytest-xdist) apart. The runner is
scripts/execute_notebooks.py, the same that saves the outputs (`make notebook-outputs`).
"""
import pytest
import torch

from scripts import execute_notebooks as runner

NOTEBOOKS = runner.notebook_paths()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch, tmp_path):
    pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[notebooks]')")
    pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[notebooks]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[notebooks]')")
    kernel_tmp = tmp_path / "tmp"
    kernel_tmp.mkdir()
    matplotlibrc_dir = tmp_path / "mplrc"
    matplotlibrc_dir.mkdir()
    for name, value in runner.kernel_environment(kernel_tmp, torch.cuda.is_available(), matplotlibrc_dir).items():
        monkeypatch.setenv(name, value)  # the kernel inherits os.environ when it starts
    runner.execute_notebook(path, kernel_tmp)  # raises CellExecutionError naming the failing cell
    left = runner.leftover_files(kernel_tmp)
    assert not left, f"{path.name} left temporary files behind: {left}"


def test_notebooks_are_committed_with_clean_outputs():
    """What the repository page shows: every code cell run, no errors or tracebacks, no paths of the
    machine that ran them, no progress bars, and not too many bytes."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[notebooks]')")
    assert NOTEBOOKS, f"no notebooks found in {runner.NOTEBOOK_DIR}"
    problems = []
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        problems += runner.output_problems(notebook, path.name)
        stderr = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
                  and any(o.get("name") == "stderr" for o in cell.get("outputs", []))]
        if stderr:
            problems.append(f"{path.name}: cells {stderr} kept stderr output")
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    if total > runner.MAX_NOTEBOOKS_BYTES:
        problems.append(f"notebooks/ takes {total} bytes (limit {runner.MAX_NOTEBOOKS_BYTES})")
    assert not problems, "\n".join(problems) + "\n(regenerate with `make notebook-outputs`)"


def test_output_check_catches_noise():
    """The clean-output check is not vacuous: it flags an error, a machine path and a missing run."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[notebooks]')")
    cell = nbformat.v4.new_code_cell("print(1)", execution_count=1, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="loaded /tmp/abc/model\n"),
        nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[]),
    ])
    unrun = nbformat.v4.new_code_cell("x = 1")
    problems = runner.output_problems(nbformat.v4.new_notebook(cells=[cell, unrun]), "x.ipynb")
    assert any("machine path" in p for p in problems)
    assert any("error output" in p for p in problems)
    assert any("cell 1 was not executed" in p for p in problems)
    clean = nbformat.v4.new_code_cell("print(1)", execution_count=1,
                                      outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])
    assert runner.output_problems(nbformat.v4.new_notebook(cells=[clean]), "y.ipynb") == []
