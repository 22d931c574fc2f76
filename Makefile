# The two quick-start commands (README): `make demo` and `make test`. Each sets up .venv first.
.PHONY: setup demo demo-smollm2 test test-gpu test-shared-gpu gpu-figures notebooks notebook-outputs exercise

# pytest-xdist workers for `make test`: one per core on a CPU machine; on a CUDA machine a single
# process (one GPU: every engine sizes its KV cache from the GPU's free memory) or one worker per GPU,
# each worker pinned to its own GPU (tests/conftest.py reads MINIVLLM_TEST_GPUS).
NUM_GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
TEST_WORKERS ?= $(shell if [ "$(NUM_GPUS)" -gt 1 ]; then echo $(NUM_GPUS); elif [ "$(NUM_GPUS)" -eq 1 ]; then echo 0; else echo auto; fi)

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python -m minivllm.demo
	.venv/bin/python -m minivllm.demo --smollm2

demo-smollm2: setup
	.venv/bin/python -m minivllm.demo --smollm2

test: setup
	MINIVLLM_TEST_GPUS=$(NUM_GPUS) .venv/bin/pytest -q -n $(TEST_WORKERS) --durations=15

# On a CUDA machine: the GPU tests alone (they skip cleanly elsewhere).
test-gpu: setup
	.venv/bin/pytest -q -m gpu

# JupyterLab on notebooks/, from .venv (installs the `notebooks` extra once); prints the URL to open.
notebooks: setup
	@bash scripts/notebooks.sh

# On one large GPU: the whole suite as WORKERS (8) workers sharing the card, then the tests that need
# the whole card alone, then the shared run's failures alone (scripts/test_shared_gpu.sh).
test-shared-gpu: setup
	bash scripts/test_shared_gpu.sh

# On a GPU: the benchmarks' pending GPU figures in one capped run (scripts/gpu_figures.sh; OUT_DIR=..., ONLY="ladder latency").
gpu-figures: setup
	bash scripts/gpu_figures.sh

# Run every notebook headless and save it with its outputs (what the repository page shows);
# NB=05 for the notebooks whose names start so.
notebook-outputs: setup
	.venv/bin/python scripts/execute_notebooks.py --write $(NB)

# Grade a chapter's exercises (chapters/exercises/): `make exercise CH=05`, or CH=05.1 for one.
# Without CH: the list of exercises. ARGS="-x -k causal" go to pytest.
exercise: setup
	.venv/bin/python -m chapters.exercises $(CH) $(ARGS)
