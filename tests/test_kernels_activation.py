"""silu_and_mul (Triton) against silu_and_mul_ref: out = silu(x[:, :d]) * x[:, d:], ragged shapes."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, needs_cuda, randn
from minivllm.kernels import silu_and_mul, silu_and_mul_ref
from minivllm.layers.activation import SiluAndMul

# The package's `silu_and_mul` is the function; the file of the same name is reached by its full name.
activation_module = importlib.import_module("minivllm.kernels.silu_and_mul")

# Both sides compute silu(g) * u in float32 and round once to the output dtype; only exp() and the
# division differ (numpy's or the GPU's fast ex2.approx/div.full vs PyTorch's). ex2.approx loses about
# |g| * 2**-24 relative (the rounding of g * log2(e)): ~1e-6 for |g| ~ 16, ~10 float32 ulps. After
# rounding to fp16/bf16 that is at most one ulp of the output: rtol = the dtype's eps (1 ulp relative
# to any normal value), atol = its smallest normal (ulps are smaller in the subnormal range, where the
# GPU may also flush to zero). float32 outputs are not rounded: rtol 1e-5 (~80 ulps) covers exp's error.
# (Measured in the interpreter: float16 differs in ~1 of 100k elements, by 1 ulp; float32 by <= 4 ulps.)
ULP_TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=torch.finfo(torch.float32).tiny),
    torch.float16: dict(rtol=torch.finfo(torch.float16).eps, atol=torch.finfo(torch.float16).tiny),
    torch.bfloat16: dict(rtol=torch.finfo(torch.bfloat16).eps, atol=torch.finfo(torch.bfloat16).tiny),
}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    # The kernel's output starts NaN-filled: an element the tiles miss fails the comparison.
    monkeypatch.setattr(activation_module, "torch", ck.PoisonedTorch())


def _check(x):
    expected = silu_and_mul_ref(x)
    actual = silu_and_mul(x)
    num_tokens, two_d = x.shape
    assert actual.shape == (num_tokens, two_d // 2) and actual.dtype == x.dtype
    assert actual.is_contiguous()
    assert not actual.isnan().any(), "NaN in the kernel output (an element was never written?)"
    torch.testing.assert_close(actual, expected, **ULP_TOLERANCES[x.dtype])


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(num_tokens, d, dtype):
    _check(4 * randn(num_tokens, 2 * d, dtype=dtype))  # |x| up to ~16: both tails of the sigmoid


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_model_width(num_tokens, dtype):
    _check(4 * randn(num_tokens, 2 * 3072, dtype=dtype))  # Qwen3-0.6B: 3 column tiles of 1024


def test_silu_and_mul_many_rows():
    _check(randn(4100, 2 * 8, dtype=torch.float32))  # >= 4096 rows: 4x rows per tile, a ragged last tile


def test_silu_and_mul_strided_rows():
    wide = randn(9, 2 * 96 + 40, dtype=torch.float16)
    x = wide[:, 8:8 + 2 * 96]  # a column slice: row stride 232, last dim contiguous
    assert not x.is_contiguous() and x.stride() == (232, 1)
    _check(x)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
def test_silu_and_mul_extreme_values():
    x = torch.tensor([[-1e4, -100.0, -1.0, 0.0, 1.0, 100.0, 1e4, -0.0,
                       2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    _check(x)  # silu(-1e4) = -0 (exp overflows to inf), silu(1e4) = 1e4


def test_silu_and_mul_no_tokens():
    out = silu_and_mul(randn(0, 2 * 64, dtype=torch.float16))
    assert out.shape == (0, 64) and out.dtype == torch.float16


def test_silu_and_mul_argument_errors():
    with pytest.raises(AssertionError, match="must be even"):
        silu_and_mul(randn(3, 7, dtype=torch.float32))
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        silu_and_mul(randn(2 * 64, 3, dtype=torch.float32).t())
    with pytest.raises(AssertionError, match="not supported"):
        silu_and_mul(torch.ones(3, 8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(AssertionError, match=r"\[num_tokens, 2 \* d\]"):
        silu_and_mul(randn(2, 3, 8, dtype=torch.float32))


@pytest.mark.parametrize("on_cuda, compile_small_ops", [(True, True), (True, False), (False, True)])
def test_silu_and_mul_layer_paths(on_cuda, compile_small_ops):
    """The model's layer runs plain PyTorch ops; the fused-ops layer swaps the kernel in on CUDA with
    compile_small_ops (engine/fused_ops.py), and nowhere else."""
    from minivllm.engine.fused_ops import fuse_small_ops

    x = randn(5, 2 * 96, dtype=torch.float16)
    gate, up = x.chunk(2, dim=-1)
    eager = F.silu(gate) * up  # rounds twice in fp16 (after silu, after the product): not the kernel
    layer = SiluAndMul()
    assert torch.equal(layer(x), eager)
    fuse_small_ops(layer, on_cuda, compile_small_ops, fuse_attention_prologue=False)
    assert torch.equal(layer(x), silu_and_mul(x) if on_cuda and compile_small_ops else eager)


@needs_cuda
@pytest.mark.parametrize("num_tokens", [256, 16384])  # decode batch, a full prefill step
def test_silu_and_mul_gpu_bf16(num_tokens):
    _check(4 * randn(num_tokens, 2 * 3072, dtype=torch.bfloat16))
