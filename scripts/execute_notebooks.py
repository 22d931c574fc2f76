"""Execute the course notebooks headless and, with --write, save them with their outputs.

The notebooks are committed with their outputs so that they read on the repository page without being
run. This script is the one way those outputs are made (`make notebook-outputs`), and
tests/test_notebooks.py runs the same `execute_notebook` to check that every notebook still runs.

Usage (from the repository root):
    python scripts/execute_notebooks.py --write              # every notebook, outputs saved in place
    python scripts/execute_notebooks.py --write 05 06         # the notebooks whose names start so
    python scripts/execute_notebooks.py                       # run and check only, nothing written

Each notebook runs in a fresh "python3" kernel with notebooks/ as its working directory, Triton's
interpreter when there is no CUDA, one intra-op thread, and a private TMPDIR that must be empty when
the notebook ends. Saved outputs always come from a CPU run (--write hides any GPU from the kernel), as
the notebooks say. What cells write to stderr (warnings, log lines) is not saved. Saved outputs are
checked by `output_problems`: no error outputs or tracebacks, no absolute path of the machine that ran
them, nothing oversized.
"""
import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
CELL_TIMEOUT_S = 300
# Caches that libraries keep in the temporary directory on purpose (torch.compile's, on a GPU).
LIBRARY_CACHE_PREFIXES = ("torchinductor_",)
MAX_OUTPUT_BYTES_PER_NOTEBOOK = 350_000  # a few plots
MAX_NOTEBOOKS_BYTES = 3_000_000  # notebooks/ as committed, outputs included
FIGURE_DPI = 80  # saved plots: readable on the repository page, a third smaller than matplotlib's 100
# Absolute paths that only exist on the machine that ran the notebook.
MACHINE_PATH_PATTERNS = (r"/tmp/", r"/home/", r"/root/", r"/Users/", r"/work/", r"/private/var/", r"site-packages")


def notebook_paths(prefixes=()) -> list[Path]:
    paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if prefixes:
        paths = [p for p in paths if p.name.startswith(tuple(prefixes))]
    return paths


def kernel_environment(tmpdir: Path, cuda_available: bool, matplotlibrc_dir: Path | None = None) -> dict:
    """The variables the notebook's kernel starts with (it inherits os.environ when it starts).
    matplotlibrc_dir: a folder outside tmpdir for the matplotlibrc that sets the plots' resolution."""
    env = {
        # This checkout's package, not whichever copy is installed in the environment.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "TMPDIR": str(tmpdir),  # tempfile.mkdtemp() in the notebook lands here
        # Progress bars redraw themselves with carriage returns: noise in a saved output.
        "TQDM_DISABLE": "1",
    }
    if matplotlibrc_dir is not None:
        (matplotlibrc_dir / "matplotlibrc").write_text(f"figure.dpi: {FIGURE_DPI}\n")
        env["MATPLOTLIBRC"] = str(matplotlibrc_dir)
    if not cuda_available:
        # Later chapters run Triton kernels; without CUDA they must run in Triton's interpreter,
        # which has to be chosen before triton is first imported in the kernel.
        env["TRITON_INTERPRET"] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        # The notebooks' tiny models gain nothing from intra-op threads, and on a CPU shared with other
        # work a thread pool turns every small op into a wait on a barrier.
        env["OMP_NUM_THREADS"] = "1"
    return env


def execute_notebook(path: Path, tmpdir: Path):
    """Run the notebook at `path` in a fresh kernel; return the executed notebook (nbformat node).

    The caller has set os.environ to `kernel_environment(tmpdir, ...)`. Raises nbclient's
    CellExecutionError (naming the failing cell, with its traceback) when a cell fails.
    """
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     record_timing=False,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
    return notebook


def drop_stderr(notebook) -> None:
    """Drop what cells wrote to stderr (library warnings, log lines naming temporary directories):
    a reader wants what the cell shows, not the machine it ran on."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.get("outputs", [])
                            if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]


def leftover_files(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith(LIBRARY_CACHE_PREFIXES))


def _output_texts(output) -> list[str]:
    if output.get("output_type") == "stream":
        return [output.get("text", "")]
    data = output.get("data", {})
    return [data[k] if isinstance(data[k], str) else "".join(data[k])
            for k in ("text/plain", "text/html", "text/markdown") if k in data]


def output_problems(notebook, name: str) -> list[str]:
    """What is wrong with a notebook's saved outputs: missing, errors, machine paths, oversized."""
    import json

    problems = []
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    if not any(c.get("outputs") for c in code_cells):
        problems.append(f"{name}: no cell has an output; run `make notebook-outputs`")
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("execution_count") is None:
            problems.append(f"{name}: cell {i} was not executed")
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                problems.append(f"{name}: cell {i} has an error output ({output.get('ename')})")
                continue
            for text in _output_texts(output):
                if "Traceback (most recent call last)" in text:
                    problems.append(f"{name}: cell {i} printed a traceback")
                for pattern in MACHINE_PATH_PATTERNS:
                    if re.search(pattern, text):
                        problems.append(f"{name}: cell {i} output shows a machine path ({pattern!r})")
                if "\r" in text:
                    problems.append(f"{name}: cell {i} output has carriage returns (a progress bar?)")
    size = len(json.dumps([c.get("outputs", []) for c in code_cells]))
    if size > MAX_OUTPUT_BYTES_PER_NOTEBOOK:
        problems.append(f"{name}: outputs take {size} bytes (limit {MAX_OUTPUT_BYTES_PER_NOTEBOOK})")
    return problems


def main(argv=None) -> int:
    import nbformat
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only the notebooks whose names start so (e.g. 05)")
    parser.add_argument("--write", action="store_true", help="save each notebook with its outputs")
    parser.add_argument("--out", type=Path, help="save every executed notebook in this folder instead, "
                                                 "problems or not (to look at them)")
    args = parser.parse_args(argv)
    paths = notebook_paths(args.prefixes)
    if not paths:
        parser.error(f"no notebook in {NOTEBOOK_DIR} starts with {args.prefixes}")
    failed = []
    for path in paths:
        with tempfile.TemporaryDirectory(prefix="nb-") as tmp, tempfile.TemporaryDirectory(prefix="mplrc-") as rc:
            tmpdir = Path(tmp)
            saved = dict(os.environ)
            os.environ.update(kernel_environment(tmpdir, torch.cuda.is_available() and not args.write, Path(rc)))
            if args.write:
                os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the saved outputs are a CPU run's
            try:
                notebook = execute_notebook(path, tmpdir)
            except Exception as e:  # a failing cell: report it, go on with the others
                failed.append(path.name)
                print(f"FAILED {path.name}: {str(e)[-2000:]}", file=sys.stderr)
                continue
            finally:
                os.environ.clear()
                os.environ.update(saved)
            drop_stderr(notebook)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                nbformat.write(notebook, args.out / path.name)
            problems = output_problems(notebook, path.name)
            left = leftover_files(tmpdir)
            if left:
                problems.append(f"{path.name}: left temporary files behind: {left}")
        if problems:
            failed.append(path.name)
            print("\n".join(problems), file=sys.stderr)
            continue
        if args.write:
            nbformat.write(notebook, path)
        print(f"ok {path.name}" + (" (written)" if args.write else ""), flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
