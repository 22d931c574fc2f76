"""The core-and-layers rule, kept by the suite: minivllm/core/ is the teaching path (small, short
functions, no layer's option in it, importing no layer), and the reading path that
HowToApproachvLLM.md lists stays readable in one sitting."""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "minivllm" / "core"
CORE_LINE_BUDGET = 1800
READING_PATH_BUDGET = 3200
FUNCTION_LINE_BUDGET = 50
# Config fields that belong to a layer of the engine (minivllm/engine/): core never names them.
LAYER_OPTIONS = ("async_scheduling", "kv_cache_dtype", "calculate_kv_scales", "quantization", "quant_config",
                 "tensor_parallel_size", "enforce_eager", "max_prompt_graph_tokens", "compile_small_ops",
                 "small_batch_gemv",
                 "mixed_step_attention", "speculative_config", "step_trace", "gpu_memory_utilization")


def core_files() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def num_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def lint_imports(cwd: Path, config: Path) -> subprocess.CompletedProcess:
    program = Path(sys.executable).with_name("lint-imports")
    if not program.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(program), "--config", str(config), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    run = lint_imports(REPO, REPO / "pyproject.toml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout


def test_the_import_contracts_catch_a_core_module_that_imports_a_layer(tmp_path):
    shutil.copytree(REPO / "minivllm", tmp_path / "minivllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "minivllm" / "core" / "sequence.py", "a") as f:
        f.write("\nfrom minivllm.engine import async_scheduling  # noqa\n")
    run = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    assert run.returncode != 0 and "minivllm.core is not allowed to import minivllm.engine" in run.stdout, run.stdout


def test_core_fits_its_line_budget():
    total = sum(num_lines(path) for path in core_files())
    assert total <= CORE_LINE_BUDGET, f"minivllm/core/ is {total} lines (budget {CORE_LINE_BUDGET})"


def test_no_core_function_is_longer_than_its_budget():
    long = []
    for path in core_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > FUNCTION_LINE_BUDGET:
                    long.append(f"{path.name}:{node.name} ({node.end_lineno - start + 1} lines)")
    assert not long, long


def test_core_names_no_option_of_a_layer():
    found = [f"{path.name}:{i}: {name}" for path in core_files()
             for i, line in enumerate(path.read_text().splitlines(), start=1)
             for name in LAYER_OPTIONS if re.search(rf"\b{name}\b", line)]
    assert not found, found


def reading_path() -> list[Path]:
    """The files HowToApproachvLLM.md's "The reading path" section lists, in its order."""
    text = (REPO / "HowToApproachvLLM.md").read_text()
    section = text.split("## The reading path", 1)[1].split("\n## ", 1)[0]
    return [REPO / p for p in re.findall(r"^\d+\. `([^`]+\.py)`", section, flags=re.M)]


def test_the_reading_path_covers_core_and_fits_its_budget():
    paths = reading_path()
    assert all(p.exists() for p in paths), [str(p) for p in paths if not p.exists()]
    assert set(core_files()) - {CORE / "__init__.py"} <= set(paths), "a core file is missing from the reading path"
    total = sum(num_lines(p) for p in paths)
    assert total <= READING_PATH_BUDGET, f"the reading path is {total} lines (budget {READING_PATH_BUDGET})"


def _import_kernels_from_the_checkout(*extra_path: Path) -> str:
    """What `import kernels` gives in a fresh interpreter whose sys.path starts with the checkout."""
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]; import kernels; "
        "print(getattr(kernels, 'WHO', 'ours' if hasattr(kernels, 'store_kvcache') else 'neither'))"
    )
    paths = [str(REPO), *map(str, extra_path)]
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_checkout_hands_import_kernels_to_the_hub_package(tmp_path):
    # transformers >= 5.25 depends on the hub `kernels` package and imports names from it; a checkout
    # first on sys.path must not shadow it with this repository's `kernels/` folder.
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("from .layer import WHO\n")
    (hub / "layer.py").write_text("WHO = 'hub'\n")
    assert _import_kernels_from_the_checkout(tmp_path / "site") == "hub"


def test_without_a_hub_package_the_folder_imports_as_itself():
    import importlib.machinery

    elsewhere = [p for p in sys.path if p and Path(p).resolve() != REPO]
    if importlib.machinery.PathFinder.find_spec("kernels", elsewhere) is not None:
        pytest.skip("the hub `kernels` package is installed in this environment")
    assert _import_kernels_from_the_checkout() == "ours"
