"""Paired benchmarks: each of our kernels against the naive PyTorch version and a library peer.

vLLM: benchmarks/kernels/ (one script per kernel) and benchmarks/benchmark_throughput.py.
Run from the repository root: `python -m benchmarks.bench_prefill` (see benchmarks/README.md).
"""
