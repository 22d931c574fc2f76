# The two quick-start commands (README): `make demo` and `make test`. Each sets up .venv first.
.PHONY: setup demo demo-smollm2 test test-gpu

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python -m minivllm.demo
	.venv/bin/python -m minivllm.demo --smollm2

demo-smollm2: setup
	.venv/bin/python -m minivllm.demo --smollm2

test: setup
	.venv/bin/pytest -q

# On a CUDA machine: the GPU tests alone (they skip cleanly elsewhere).
test-gpu: setup
	.venv/bin/pytest -q -m gpu
