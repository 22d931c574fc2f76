"""The small-batch GEMV (kernels/gemv.py) against gemv_ref, and gemv_ref against the model's own layers:
every prologue, 1 to 16 rows, multiply-adds and tensor-core tiles, 1 to 3 splits of K, ragged N and K,
strided rows, the split-K counters left at zero, and the argument checks."""
import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, needs_cuda, randn
from minivllm.kernels.gemv import GemvConfig, PROLOGUES, gemv, gemv_config, gemv_ref
from minivllm.kernels.silu_and_mul import silu_and_mul_ref
from minivllm.layers.layernorm import add_rms_norm, rms_norm

gemv_module = importlib.import_module("minivllm.kernels.gemv")

# Both sides accumulate in float32 and round once; only the order of the additions differs (and, in
# the prologues, exp() and 1/sqrt), which moves a rounded half-precision output by at most an ulp or
# so of values ~1. float32 outputs are not rounded: K = 200 products of ~0.3 differ by ~1e-6.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    # Outputs and the split-K workspace start NaN-filled: an element the tiles miss fails the comparison.
    monkeypatch.setattr(gemv_module, "torch", ck.PoisonedTorch())


def inputs(prologue, m, n, k, dtype, bias=True):
    """x, weight and the keyword arguments of `prologue`, values of the model's magnitudes."""
    x = randn(m, 2 * k if prologue == "silu_and_mul" else k, dtype=dtype)
    weight = (randn(n, k, dtype=torch.float32) / k**0.5).to(dtype)
    kwargs = dict(bias=randn(n, dtype=dtype) if bias else None, prologue=prologue)
    if prologue in ("rms_norm", "add_rms_norm"):
        kwargs.update(norm_weight=(torch.rand(k, device=DEVICE) + 0.5).to(dtype), eps=1e-6)
    if prologue == "add_rms_norm":
        kwargs.update(residual=randn(m, k, dtype=dtype))
    return x, weight, kwargs


def check(x, weight, config=None, **kwargs):
    expected = gemv_ref(x, weight, **kwargs)
    actual = gemv(x, weight, config=config, **kwargs)
    if kwargs.get("prologue") == "add_rms_norm":
        (actual, summed), (expected, expected_sum) = actual, expected
        assert torch.equal(summed, expected_sum), "the residual stream differs from x + residual"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert not actual.isnan().any(), "NaN in the output (an element was never written?)"
    torch.testing.assert_close(actual, expected, **TOLERANCES[x.dtype])
    return actual


@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_the_models_layers(prologue, dtype):
    """gemv_ref rounds where the unfused layers round: RMSNorm (+ the add), SiLU-and-mul, then the linear."""
    x, weight, kwargs = inputs(prologue, 3, 24, 64, dtype)
    if prologue == "add_rms_norm":
        normed, summed = add_rms_norm(x, kwargs["residual"], kwargs["norm_weight"], kwargs["eps"])
    elif prologue == "rms_norm":
        normed, summed = rms_norm(x, kwargs["norm_weight"], kwargs["eps"]), None
    else:
        normed, summed = silu_and_mul_ref(x), None
    expected = F.linear(normed.float(), weight.float(), kwargs["bias"].float()).to(dtype)
    actual = gemv_ref(x, weight, **kwargs)
    if summed is not None:
        actual, actual_sum = actual
        assert torch.equal(actual_sum, summed)
    assert torch.equal(actual, expected)


# (BLOCK_N, BLOCK_K, SPLIT_K, DOT): one K-tile per split and several, a last split shorter than the rest
CONFIGS = [GemvConfig(8, 32, 1, False), GemvConfig(8, 32, 3, False), GemvConfig(16, 64, 2, True),
           GemvConfig(16, 32, 3, True)]


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.BLOCK_N}k{c.BLOCK_K}s{c.SPLIT_K}{'dot' * c.DOT}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_reference(prologue, m, config, dtype):
    if config.DOT and dtype == torch.float32:
        pytest.skip("tensor-core tiles are for half dtypes (float32 would round to tf32 on the GPU)")
    x, weight, kwargs = inputs(prologue, m, 37, 200, dtype)  # 37 outputs: a ragged last tile
    check(x, weight, config, **kwargs)


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("m", [1, 4])
def test_default_tiles_at_model_like_widths(prologue, m):
    """gemv_config's own choice (under the interpreter: one large tile), no bias, float16."""
    x, weight, kwargs = inputs(prologue, m, 13, 1024, torch.float16, bias=False)
    check(x, weight, **kwargs)


def test_the_tile_rule_on_a_gpu(monkeypatch):
    """On an H200 (132 SMs): multiply-adds below 4 rows and for float32, with K tiles as long as their
    products fit (a whole 1024-wide row at batch 1); tensor-core tiles from 4 rows of a half dtype; K
    split until two programs per SM."""
    monkeypatch.setattr(gemv_module, "is_interpreter", lambda: False)
    monkeypatch.setattr(gemv_module, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # QKV of Qwen3-0.6B at batch 1: 1,024 tiles of 4 outputs, each one K tile (the whole row)
    assert gemv_config(1, 4096, 1024, torch.bfloat16, cuda) == GemvConfig(4, 1024, 1, False)
    # o_proj at batch 1: 256 tiles, 2 splits of 1,024 (512 programs)
    assert gemv_config(1, 1024, 2048, torch.bfloat16, cuda) == GemvConfig(4, 1024, 2, False)
    assert gemv_config(2, 1024, 2048, torch.bfloat16, cuda).BLOCK_K == 512  # twice the rows: half the K tile
    assert gemv_config(16, 1024, 2048, torch.bfloat16, cuda) == GemvConfig(16, 128, 4, True)  # 64 tiles x 4
    assert gemv_config(4, 151936, 1024, torch.float32, cuda) == GemvConfig(4, 256, 1, False)  # the LM head: no split
    assert gemv_config(16, 1024, 2048, torch.float32, cuda).BLOCK_K == 64  # 16 float32 rows: short tiles
    assert gemv_config(1, 4096, 256, torch.bfloat16, cuda).SPLIT_K == 1  # K too short to split


def test_strided_rows_and_a_float32_output():
    """x's rows inside a wider tensor (the way a slice of a packed projection arrives); float32 logits."""
    wide = randn(3, 300, dtype=torch.float16)
    x, weight = wide[:, :200], (randn(50, 200, dtype=torch.float32) / 14).to(torch.float16)
    assert not x.is_contiguous()
    actual = check(x, weight, GemvConfig(16, 32, 2, True), out_dtype=torch.float32)
    assert actual.dtype == torch.float32


def test_split_k_counters_return_to_zero_and_calls_repeat_bit_for_bit():
    """The last split of each tile resets its counter: a second call (or a CUDA-graph replay) finds them
    at zero, and the fixed order of the partial sums gives the same bits."""
    x, weight, kwargs = inputs("add_rms_norm", 2, 64, 256, torch.float16)
    config = GemvConfig(16, 32, 4, True)
    first = gemv(x, weight, config=config, **kwargs)
    counters = gemv_module._tile_counters(x.device)
    assert counters.count_nonzero() == 0
    second = gemv(x, weight, config=config, **kwargs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("change, message", [
    (dict(prologue="gelu"), "prologue must be one of"),
    (dict(x=torch.zeros(2, 48)), "columns"),
    (dict(residual=None), "needs residual"),
    (dict(norm_weight=None), "needs norm_weight"),
    (dict(prologue="none"), "takes no norm_weight"),
    (dict(norm_weight=torch.ones(5)), "norm_weight must be"),
    (dict(residual=torch.zeros(3, 64)), "residual must be"),
    (dict(bias=torch.zeros(7)), "bias must be"),
    (dict(weight=torch.zeros(32, 64, dtype=torch.float64)), "must share one of"),
    (dict(weight=torch.zeros(64, 32).t()), "contiguous"),
])
def test_bad_arguments_are_refused(change, message):
    args = dict(x=torch.zeros(2, 64), weight=torch.zeros(32, 64), bias=None, prologue="add_rms_norm",
                norm_weight=torch.ones(64), residual=torch.zeros(2, 64))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        gemv(**args)


@needs_cuda
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_qwen3_shapes_in_a_cuda_graph(prologue, m):
    """bf16 at Qwen3-0.6B's widths with the default tiles, captured once and replayed twice: the same
    bits each replay (the counters reset inside the graph), and the reference's values."""
    n, k = (3072, 1024) if prologue == "silu_and_mul" else (4096, 1024)
    x, weight, kwargs = inputs(prologue, m, n, k, torch.bfloat16, bias=False)
    expected = check(x, weight, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight, **kwargs)
    out = out[0] if prologue == "add_rms_norm" else out
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(out.clone())
    assert torch.equal(replays[0], replays[1]) and torch.equal(replays[0], expected)


def test_every_variant_compiles_for_hopper_without_a_gpu():
    """The interpreter the CPU tests use does not run Triton's compiler; this compiles each variant the
    engine can launch for sm_90 (tests/compile_for_hopper.py, a process without TRITON_INTERPRET), and a
    planted kernel that reads a plain global must fail there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(repo / "tests" / "compile_for_hopper.py"), "gemv", "moe-small", "planted"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=500)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("ok     gemv") for line in lines) == 96, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(line.startswith("ok     moe few-pairs") for line in lines) == 8, proc.stdout[-3000:]
    assert [line for line in lines if line.startswith("FAILED")] == [
        line for line in lines if line.startswith("FAILED planted")] != [], proc.stdout[-3000:]
    assert "Cannot access global variable PLANTED_LIMIT" in proc.stdout
    assert proc.returncode == 1
