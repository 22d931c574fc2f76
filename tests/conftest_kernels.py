"""Shared helpers for the kernel tests (tests/test_kernels_*.py): device, tolerances, ragged inputs,
paged caches with shuffled block tables, and NaN-poisoned output allocation.

Importing this module first turns on the Triton interpreter when there is no GPU: TRITON_INTERPRET
must be set before `triton.jit` decorates the kernels (tests/conftest.py does the same).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter's bf16 dot is broken: bf16 only on the GPU.
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
_skip_without_cuda = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def needs_cuda(test):
    """A GPU-only test: marked `gpu` (so `make test-gpu` selects it) and skipped without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(test))


# The Triton kernels on CPU tensors need the interpreter, which is on only where there is no GPU
# (on a CUDA machine the same kernels are tested on the GPU instead).
needs_interpreter = pytest.mark.skipif(ON_GPU, reason="Triton on CPU tensors runs only under "
                                                      "TRITON_INTERPRET, set on CPU-only machines")


# Kernel vs float32 reference. The kernels round P to the input dtype before the PV product and,
# on the GPU, run float32 dots in tf32; the interpreter computes float32 dots exactly.
TOLERANCES = {
    torch.float32: dict(atol=1e-2, rtol=1e-2) if ON_GPU else dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def compile_for_hopper(*kernels):
    """Run tests/compile_for_hopper.py on these kernel families in a process without TRITON_INTERPRET
    (the compiler the interpreter never runs): (the finished process, its stdout lines)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(repo / "tests" / "compile_for_hopper.py"), *kernels],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=500)
    return proc, proc.stdout.splitlines()


def assert_close(actual, expected):
    assert not actual.isnan().any(), "NaN in the kernel output (an element was never written?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[actual.dtype])


def cu_seqlens(lengths):
    """[0, l0, l0+l1, ...] as int32 on DEVICE."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(DEVICE)


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32, device=DEVICE).to(dtype)


def paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Random k/v caches and a shuffled block table covering each context (ids not contiguous).

    Returns k_cache, v_cache [num_blocks, block_size, kvh, d] and block_table [batch, max_blocks]
    (int32; entries past a sequence's last block point at random blocks, as stale rows do).
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks)
    block_table = torch.randint(0, num_blocks, (len(context_lens), max_blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start:start + n].to(torch.int32)
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), block_table.to(DEVICE)


class PoisonedTorch:
    """Stands in for the `torch` module inside a kernel file: torch.empty/empty_like return
    NaN-filled float tensors, so an output element the kernel never writes fails the test."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


def fresh_kernels(monkeypatch, module):
    """Replace each @triton.jit function of `module` by a new copy of itself, for the tests that put a
    known wrong device function into a kernel module: a compiled function fixes its hash, which names
    the functions it calls, the first time it runs, so a kernel that already ran would keep calling
    the right ones (and find its old binary in Triton's cache). The copies hash what the module holds
    when they first run. (The interpreter looks names up as it goes; the copies do no harm there.)"""
    import triton

    for name, value in list(vars(module).items()):
        if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
            assert not getattr(value, "do_not_specialize", None), f"{name}: copy its jit options too"
            monkeypatch.setattr(module, name, triton.jit(value.fn))
