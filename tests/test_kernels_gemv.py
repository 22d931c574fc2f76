"""The small-batch GEMV (kernels/gemv.py) against gemv_ref, and gemv_ref against the model's own layers:
every prologue, 1 to 16 rows, multiply-adds and tensor-core tiles, 1 to 3 splits of K, ragged N and K,
strided rows, the split-K counters left at zero, and the argument checks. Beyond the outputs: each
prologue's rounding, through an identity weight; each split's partial in the workspace, and the output
as their sum in split order, bit for bit, whichever split finishes last. They grade exercise 17.1
(gemv_kernel, the whole kernel); the known wrong answers at the end must fail them."""
import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import conftest_kernels as ck  # noqa: I001 (sets TRITON_INTERPRET before triton is imported)
from conftest_kernels import DEVICE, DTYPES, needs_cuda, needs_interpreter, randn
from minivllm.kernels.gemv import (ADD_RMS_NORM, PROLOGUES, RMS_NORM, SILU_AND_MUL, GemvConfig, _row_rstd, gemv,
                                   gemv_config, gemv_ref)
from minivllm.kernels.silu_and_mul import silu_and_mul_ref
from minivllm.layers.layernorm import add_rms_norm, rms_norm
from wrong_answers import KernelWithOnePieceBroken, builds_on_the_engine, case_id, rejected

gemv_module = importlib.import_module("minivllm.kernels.gemv")
common_module = importlib.import_module("minivllm.kernels._common")
HALF_DTYPES = [dtype for dtype in DTYPES if dtype != torch.float32]

# Both sides accumulate in float32 and round once; only the order of the additions differs (and, in
# the prologues, exp() and 1/sqrt), which moves a rounded half-precision output by at most an ulp or
# so of values ~1. float32 outputs are not rounded: K = 200 products of ~0.3 differ by ~1e-6.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
              torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    # Outputs and the split-K workspace start NaN-filled: an element the tiles miss fails the comparison.
    monkeypatch.setattr(gemv_module, "torch", ck.PoisonedTorch())


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch):
    # Each test starts from zeroed split-K counters: a kernel that leaves them set fails the test that
    # checks them, not every split-K test after it.
    monkeypatch.setattr(common_module, "_counters", {})


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
    assert counters.count_nonzero() == 0, ("a tile's counter was left set: in the next call no split sees "
                                           "SPLIT_K - 1, and the outputs stay unwritten")
    second = gemv(x, weight, config=config, **kwargs)
    assert not second[0].isnan().any(), "the second call left outputs unwritten"
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert counters.count_nonzero() == 0


def prologue_output(x, kwargs):
    """[M, K]: what the prologue of `kwargs` feeds the GEMV, the unfused layers' (gemv_ref through an
    identity weight: each product by 1 or 0, and their sum, is exact)."""
    k = x.shape[1] // 2 if kwargs["prologue"] == "silu_and_mul" else x.shape[1]
    eye = torch.eye(k, dtype=x.dtype, device=DEVICE)
    a = gemv_ref(x, eye, **{name: value for name, value in kwargs.items() if name != "bias"})
    return a[0] if kwargs["prologue"] == "add_rms_norm" else a


@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_each_prologue_rounds_where_the_layers_round(prologue, dtype):
    """Through an identity weight the GEMV hands back its prologue's output itself. It is the unfused
    layers' bit for bit, but for the last bit of the rare value that 1/sqrt or exp() leaves on a
    rounding boundary; a prologue that rounds once where the layers round twice (or the other way
    round) differs in a large share of the values, by an ulp: within the outputs' tolerance."""
    x, _, kwargs = inputs(prologue, 8, 1, 256, dtype, bias=False)
    eye = torch.eye(256, dtype=dtype, device=DEVICE)
    actual = gemv(x, eye, **kwargs)
    actual = actual[0] if prologue == "add_rms_norm" else actual
    expected = prologue_output(x, kwargs)
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
    differ = (actual != expected).float().mean().item()
    assert differ <= 0.01, f"{differ:.0%} of the prologue's values are rounded otherwise than the layers round them"


class RecordingTorch(ck.PoisonedTorch):
    """PoisonedTorch that keeps what the wrapper allocates: the split-K workspace among them."""

    def __init__(self):
        self.allocated = []

    def empty(self, *args, **kwargs):
        self.allocated.append(super().empty(*args, **kwargs))
        return self.allocated[-1]


def run_the_last_split_first(monkeypatch):
    """The interpreter runs a grid's programs one at a time, the splits of a tile in order, so the last
    split always counts last; on a GPU any may. Reverse them: the last split runs first, split 0 last."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx
    monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_grid_idx(x, builder.grid_dim[1] - 1 - y, z))


# (dtype, config): multiply-adds and tensor-core tiles, 3 splits of K: of 200, 96, 96 and 8 columns; of
# 192, 64 each (on a GPU the split launched last then most often finishes last and sums)
SPLIT_CONFIGS = [(torch.float32, GemvConfig(8, 32, 3, False)), (torch.float16, GemvConfig(16, 32, 3, True))]
SPLIT_KS = {"short_last_split": 200, "equal_splits": 192}


@pytest.mark.parametrize("k", SPLIT_KS.values(), ids=SPLIT_KS.keys())
@pytest.mark.parametrize("order", ["launch_order", pytest.param("last_split_first", marks=needs_interpreter)])
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("dtype, config", SPLIT_CONFIGS, ids=["multiply_adds", "dot"])
def test_the_last_split_sums_the_partials_in_split_order(dtype, config, prologue, order, k, monkeypatch):
    """Split s leaves in the workspace [SPLIT_K, M, N] the float32 product of the prologue's output and
    the weight over its own columns of K; the output is those partials summed in split order, the bias
    added, rounded once: bit for bit in a float32 output, where any other order of the additions shows,
    and whichever split finishes last."""
    recorder = RecordingTorch()
    monkeypatch.setattr(gemv_module, "torch", recorder)
    if order == "last_split_first":
        run_the_last_split_first(monkeypatch)
    m, n = 3, 37
    x, weight, kwargs = inputs(prologue, m, n, k, dtype)
    out = gemv(x, weight, config=config, out_dtype=torch.float32, **kwargs)
    out = out[0] if prologue == "add_rms_norm" else out
    [partial] = [t for t in recorder.allocated if t.dim() == 3]  # [SPLIT_K, M, N]
    assert not partial.isnan().any(), "a split left part of its partial unwritten"
    a = prologue_output(x, kwargs)  # [M, K]
    k_per_split = triton.cdiv(triton.cdiv(k, config.SPLIT_K), config.BLOCK_K) * config.BLOCK_K
    expected = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
    for split in range(config.SPLIT_K):
        columns = slice(split * k_per_split, min(k, (split + 1) * k_per_split))
        torch.testing.assert_close(partial[split], a[:, columns].float() @ weight[:, columns].float().T,
                                   **TOLERANCES[dtype], msg=lambda text: f"split {split}'s partial: {text}")
        expected += partial[split]
    expected += kwargs["bias"].float()
    assert not out.isnan().any(), "NaN in the output: was it summed before every split had written its partial?"
    assert torch.equal(out, expected), "the output is not the partials summed in split order, then the bias"


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
    proc, lines = ck.compile_for_hopper("gemv", "moe-small", "moe", "planted")
    assert sum(line.startswith("ok     gemv") for line in lines) == 144, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(line.startswith("ok     moe few-pairs") for line in lines) == 16 + 8, proc.stdout[-3000:]
    assert sum(line.startswith("ok     moe aligned") for line in lines) == 8, proc.stdout[-3000:]
    assert [line for line in lines if line.startswith("FAILED")] == [
        line for line in lines if line.startswith("FAILED planted")] != [], proc.stdout[-3000:]
    assert "Cannot access global variable PLANTED_LIMIT" in proc.stdout
    assert proc.returncode == 1


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 17.1. A wrong kernel is the test's
# copy of gemv_kernel below with one piece broken, launched where gemv launches the engine's.
# ------------------------------------------------------------------------------------------------

PIECES = ["nothing", "zeros", "norm_skipped", "norm_rounded_once", "residual_not_written",
          "residual_of_the_first_split_only", "own_partial_only", "own_partial_first", "counter_not_reset",
          "last_split_sums_without_counting"]
NOTHING, ZEROS, NORM_SKIPPED, NORM_ROUNDED_ONCE, RESIDUAL_NOT_WRITTEN, RESIDUAL_OF_THE_FIRST_SPLIT_ONLY, \
    OWN_PARTIAL_ONLY, OWN_PARTIAL_FIRST, COUNTER_NOT_RESET, LAST_SPLIT_SUMS_WITHOUT_COUNTING = (
        tl.constexpr(i) for i in range(len(PIECES)))


@triton.jit(do_not_specialize=["M", "eps"])
def gemv_with_one_piece_broken(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr, partial_ptr, counter_ptr,
    M, N, K, k_per_split, stride_x, stride_res, stride_sum, stride_w, stride_out, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BROKEN: tl.constexpr,
):
    """gemv_kernel, with the piece BROKEN names broken (NOTHING: none)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = offs_n.to(tl.int64) * stride_w
    dtype = w_ptr.dtype.element_ty

    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        rstd = _row_rstd(x_ptr, res_ptr, rows, m_mask, K, stride_x, stride_res, eps,
                         PROLOGUE == ADD_RMS_NORM, BLOCK_M, BLOCK_K)
        if BROKEN == NORM_SKIPPED:
            rstd = rstd * 0.0 + 1.0

    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_offs = rows[:, None] * stride_x + offs_k[None, :]
        if PROLOGUE == SILU_AND_MUL:
            gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
        else:
            a = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
            if PROLOGUE == ADD_RMS_NORM:
                r = tl.load(res_ptr + rows[:, None] * stride_res + offs_k[None, :], mask=x_mask, other=0.0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
                writes_the_stream = pid_n == 0
                if BROKEN == RESIDUAL_OF_THE_FIRST_SPLIT_ONLY:
                    writes_the_stream = (pid_n == 0) & (pid_k == 0)
                if BROKEN != RESIDUAL_NOT_WRITTEN:
                    if writes_the_stream:
                        tl.store(res_out_ptr + rows[:, None] * stride_sum + offs_k[None, :], a, mask=x_mask)
            if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
                g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                if BROKEN == NORM_ROUNDED_ONCE:
                    a = (a.to(tl.float32) * rstd[:, None] * g[None, :]).to(dtype)
                else:
                    a = ((a.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32) * g[None, :]).to(dtype)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT and dtype == tl.float32:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        elif DOT:
            acc += tl.dot(a.to(dtype), tl.trans(w))
        else:
            products += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(products, axis=2)
    if BROKEN == ZEROS:  # the trivial answer: the bias alone
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    out_mask = m_mask[:, None] & n_mask[None, :]
    out_offs = rows[:, None] * stride_out + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_offs = rows[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * N + part_offs, acc, mask=out_mask)
        if BROKEN == LAST_SPLIT_SUMS_WITHOUT_COUNTING:
            done = pid_k  # the last split, not the last program to finish
        else:
            done = tl.atomic_add(counter_ptr + pid_n, 1)
        if done == SPLIT_K - 1:
            if BROKEN == OWN_PARTIAL_ONLY:
                total = acc
            elif BROKEN == OWN_PARTIAL_FIRST:  # its own partial from registers, then the others'
                total = acc
                for s in tl.static_range(SPLIT_K):
                    if s != pid_k:
                        total += tl.load(partial_ptr + s * M * N + part_offs, mask=out_mask, other=0.0,
                                         cache_modifier=".cg")
            else:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(partial_ptr + s * M * N + part_offs, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            if BROKEN != COUNTER_NOT_RESET:
                tl.store(counter_ptr + pid_n, 0)


def one_piece_broken(piece: str) -> KernelWithOnePieceBroken:
    """Stands in for the engine's kernel: launches gemv_with_one_piece_broken with `piece` broken."""
    return KernelWithOnePieceBroken(gemv_with_one_piece_broken, PIECES, piece)


def check_outputs():
    for prologue, config in itertools.product(PROLOGUES, CONFIGS[:2]):  # one split and three
        test_gemv_matches_reference(prologue, 5, config, torch.float32)


def check_rounding():
    test_each_prologue_rounds_where_the_layers_round("rms_norm", HALF_DTYPES[0])


def check_counters():
    test_split_k_counters_return_to_zero_and_calls_repeat_bit_for_bit()


def check_split_order(order="launch_order"):
    # On a GPU which split finishes last is up to the hardware. A kernel that adds the last split's own
    # partial first gives split order's bits when split 0 or 1 finishes last (a + b == b + a), so the
    # splits are equal, where the one launched last most often finishes last, on 8 fresh draws: any
    # call out of split order fails the check.
    for _ in range(8 if ck.ON_GPU else 1):
        with pytest.MonkeyPatch.context() as monkeypatch:
            test_the_last_split_sums_the_partials_in_split_order(*SPLIT_CONFIGS[0], "none", order,
                                                                 SPLIT_KS["equal_splits"], monkeypatch)


def check_split_order_with_the_last_split_first():
    check_split_order("last_split_first")


@builds_on_the_engine
def test_the_kernel_as_the_wrong_answers_write_it_passes():
    """The copy with nothing broken is right: each wrong answer below differs from it in one piece."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(gemv_module, "gemv_kernel", one_piece_broken("nothing"))
        check_outputs()
        check_rounding()
        check_counters()
        check_split_order()
        if not ck.ON_GPU:
            check_split_order_with_the_last_split_first()


@builds_on_the_engine
@pytest.mark.parametrize("piece, check", [
    ("zeros", check_outputs),
    ("norm_skipped", check_outputs),
    ("norm_rounded_once", check_rounding),  # within the outputs' tolerance
    ("residual_not_written", check_outputs),
    ("residual_of_the_first_split_only", check_outputs),
    ("own_partial_only", check_outputs),
    ("own_partial_first", check_split_order),  # within the outputs' tolerance
    ("counter_not_reset", check_counters),
    pytest.param("last_split_sums_without_counting", check_split_order_with_the_last_split_first,
                 marks=needs_interpreter),  # right whenever the last split happens to finish last
], ids=case_id)
def test_the_gemv_checks_reject_a_wrong_kernel(piece, check):
    rejected(check, gemv_module, "gemv_kernel", one_piece_broken(piece))
