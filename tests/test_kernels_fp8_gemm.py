"""FP8 weights' kernels: block quantize/dequantize round trips, the Triton per-token-group
activation quantization (the reference's codes bit for bit) and the Triton block-scaled FP8 GEMM
against the dequantize-then-matmul reference; on the GPU also torch._scaled_mm with per-token and
per-channel scales, at the Qwen3-0.6B and Qwen3-8B linear shapes.

The activation quantization's tests grade exercise 13.1 with tests/test_kernels_fp8.py; the known wrong
kernels at the end must fail them (the grader can fail).

On the CPU the Triton kernels run in the interpreter, which (triton 3.9) loads float8_e4m3fn and
computes tl.dot on FP8 tiles exactly in float32: the kernel is tested as written, FP8 dot included.
The GPU runs the same kernel on the tensor cores (fp8 x fp8 -> fp32).
"""
import pytest
import torch
import triton
import triton.language as tl

from conftest_kernels import DEVICE, ON_GPU, needs_cuda  # noqa: I001
from minivllm.kernels import (
    dequantize_fp8_blocks_ref, per_token_group_quant_fp8, per_token_group_quant_fp8_ref, quantize_fp8_blocks_ref,
    scaled_mm_per_channel, w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref,
)
from minivllm.kernels import fp8_gemm
from minivllm.kernels.quant_fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8
from wrong_answers import KernelWithOnePieceBroken, builds_on_the_engine, case_id, rejected

FP8_REL_STEP = 2.0**-4  # e4m3 rounding to nearest: at most half of 2^-3 of the value (normal range)
# W8A8 vs the unquantized product (relative error norm): each operand carries ~2.5 % of rounding
# error in norm (uniform within +-2^-4 of each value, shrunk by the values below their block's amax);
# the two combine in quadrature to ~3.5 %.
W8A8_REL_NORM = 0.05
# Kernel vs reference: the same codes and scales; they differ in float32 summation order only
# (exact products, blocks of 128 summed then scaled), and in the output dtype's rounding. Hopper's
# FP8 tensor cores keep fewer accumulator bits than float32 (~14 of the mantissa's 23) within one
# dot: float32 output gets 1e-3 on the GPU.
GEMM_TOLERANCES = {torch.float32: dict(atol=1e-3, rtol=1e-3) if ON_GPU else dict(atol=1e-4, rtol=1e-4),
                   torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
                   torch.float16: dict(atol=2e-3, rtol=2e-3)}
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32]
# Linear layers [N, K] of Qwen3-0.6B and Qwen3-8B (tensor_parallel_size 1)
QWEN3_SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
                "0.6b down": (1024, 3072), "8b qkv": (6144, 4096), "8b o": (4096, 4096),
                "8b gate_up": (24576, 4096), "8b down": (4096, 12288)}


def rel_norm(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def operands(M, N, K, device=DEVICE):
    """Activations and a weight of realistic scale: x ~ N(0, 1) with a few outlier columns (as
    activations have), w ~ N(0, 0.02) (transformers' init)."""
    x = torch.randn(M, K, device=device)
    x[:, ::97] *= 8
    w = torch.randn(N, K, device=device) * 0.02
    return x, w


# ---- quantize / dequantize ---------------------------------------------------------------------

@pytest.mark.parametrize("block", [(128, 128), (1, 128), (1, 300), (7, 32)])
def test_block_round_trip_within_half_an_fp8_step(block):
    x = torch.randn(200, 300, device=DEVICE) * torch.logspace(-3, 2, 300, device=DEVICE)  # ragged: partial blocks
    codes, scales = quantize_fp8_blocks_ref(x, *block)
    assert codes.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert scales.shape == (-(-200 // block[0]), -(-300 // block[1]))
    back = dequantize_fp8_blocks_ref(codes, scales, *block)
    step = dequantize_fp8_blocks_ref(torch.ones_like(codes), scales, *block)  # each element's scale
    normal = x.abs() >= step * 2.0**-6  # below: e4m3 subnormals, a fixed step of scale * 2^-9
    assert ((back - x).abs() / x.abs())[normal].max() <= FP8_REL_STEP + 1e-7
    assert (back - x)[~normal].abs().max() <= (step * 2.0**-10)[~normal].max()
    # every block's largest magnitude lands on 448: the per-block amax of the codes
    code_amax = quantize_fp8_blocks_ref(codes.float(), *block)[1] * FP8_MAX
    torch.testing.assert_close(code_amax, torch.full_like(code_amax, FP8_MAX), rtol=1e-6, atol=0)


def test_zero_block_gets_zero_codes_and_a_finite_scale():
    x = torch.zeros(4, 256, device=DEVICE)
    x[1, 200] = 3.0
    codes, scales = quantize_fp8_blocks_ref(x, 1, 128)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert codes.float().count_nonzero() == 1 and codes[1, 200].float() == FP8_MAX
    torch.testing.assert_close(dequantize_fp8_blocks_ref(codes, scales, 1, 128), x, rtol=0, atol=0)


# ---- activation quantization kernel ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []))
@pytest.mark.parametrize("M", [1, 7, 33])
@pytest.mark.parametrize("K,group_size", [(384, 128), (300, 128), (384, 384), (200, 200)])
def test_per_token_group_quant_kernel_is_the_reference_bit_for_bit(dtype, M, K, group_size):
    x = (torch.randn(M, K, device=DEVICE) * 5).to(dtype)
    x[0, :group_size] = 0  # an all-zero group
    codes, scales = per_token_group_quant_fp8(x, group_size)
    ref_codes, ref_scales = per_token_group_quant_fp8_ref(x, group_size)
    assert scales.shape == (M, -(-K // group_size))
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


def test_per_token_group_quant_reads_strided_rows():
    x = torch.randn(5, 512, device=DEVICE)[:, 128:384]  # rows 512 apart, 256 columns
    codes, scales = per_token_group_quant_fp8(x, 128)
    ref_codes, ref_scales = per_token_group_quant_fp8_ref(x.contiguous(), 128)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scales, ref_scales)


def test_per_token_group_quant_rounds_every_code_and_midpoint():
    """Groups whose largest magnitude is 448 * 2^e get the scale 2^e exactly, so x / scale is exact:
    every e4m3 value, every midpoint between neighbours (ties go to even) and the floats just beside
    each midpoint, both signs, subnormals included, come out as the reference's codes."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, torch.tensor([-0.0]), mids, mids.nextafter(torch.tensor(1e9)),
                   mids.nextafter(torch.tensor(-1e9))])
    group_size = 128
    rows = -(-len(x) // (group_size - 1))  # one group a row
    rest = torch.zeros(rows * (group_size - 1))
    rest[:len(x)] = x
    groups = torch.cat([torch.full((rows, 1), FP8_MAX), rest.view(rows, group_size - 1)], dim=1)  # amax 448
    exponents = torch.arange(rows) % 5 - 2
    groups = groups * 2.0 ** exponents[:, None]  # scales 1/4 .. 4, exact
    groups = groups.to(DEVICE)
    codes, scales = per_token_group_quant_fp8(groups, group_size)
    ref_codes, ref_scales = per_token_group_quant_fp8_ref(groups, group_size)
    assert torch.equal(scales.flatten().cpu(), 2.0 ** exponents.float())
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("K, group_size", [(300, 128), (300, 100), (256, 256)])
def test_per_token_group_quant_maps_each_groups_amax_onto_448(K, group_size):
    """Each group of a row (the last one ragged) has its own scale, its amax / 448: the largest magnitude
    lands on +-448 and every value comes back within half an e4m3 step; an all-zero group keeps a finite
    scale and zero codes. Group sizes that are not powers of two read exactly their own columns."""
    torch.manual_seed(4)
    x = torch.randn(5, K, device=DEVICE) * torch.logspace(-3, 2, K, device=DEVICE)
    x[0, :group_size] = 0
    x[2, K - 1] = -1e3  # the last group's amax, negative
    codes, scales = per_token_group_quant_fp8(x, group_size)
    num_groups = -(-K // group_size)
    assert scales.shape == (5, num_groups) and scales.dtype == torch.float32
    for g in range(num_groups):
        cols = slice(g * group_size, min((g + 1) * group_size, K))
        amax = x[:, cols].abs().amax(dim=-1).clamp(min=fp8_gemm.MIN_AMAX)
        torch.testing.assert_close(scales[:, g], amax / FP8_MAX, rtol=1e-6, atol=0)
        group_codes = codes[:, cols].float()
        assert torch.equal(group_codes.abs().amax(dim=-1)[1:], torch.full((4,), FP8_MAX, device=DEVICE))
        back = group_codes * scales[:, g:g + 1]
        normal = x[:, cols].abs() >= scales[:, g:g + 1] * 2.0**-6
        assert ((back - x[:, cols]).abs() <= FP8_REL_STEP * x[:, cols].abs() + 1e-30)[normal].all()
    assert codes[2, K - 1].float().item() == -FP8_MAX
    assert torch.isfinite(scales[0, 0]) and scales[0, 0] > 0 and codes[0, :group_size].float().count_nonzero() == 0


# ---- block-scaled GEMM --------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("M", [1, 7, 33, 130])
@pytest.mark.parametrize("N,K", [(256, 384), (200, 300)])
def test_block_fp8_gemm_kernel_matches_reference(out_dtype, M, N, K):
    x, w = operands(M, N, K)
    a, a_scale = per_token_group_quant_fp8_ref(x, 128)
    b, b_scale = quantize_fp8_blocks_ref(w, 128, 128)
    out = w8a8_block_fp8_matmul(a, a_scale, b, b_scale, [128, 128], out_dtype)
    ref = w8a8_block_fp8_matmul_ref(a, a_scale, b, b_scale, [128, 128], torch.float32)
    assert out.shape == (M, N) and out.dtype == out_dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **GEMM_TOLERANCES[out_dtype])
    assert rel_norm(ref, x @ w.t()) < W8A8_REL_NORM  # and FP8 W8A8 is close to the unquantized product


@pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_SIZE_M=2, num_warps=4, num_stages=2),
                                    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2)])
def test_block_fp8_gemm_other_tiles_and_strided_a(config):
    """Tiles smaller than a scale block (two K tiles per group) and a with strided rows."""
    x, w = operands(40, 256, 512)
    a, a_scale = per_token_group_quant_fp8_ref(x, 128)
    a_wide = torch.zeros(40, 640, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    a_wide[:, :512] = a
    out = w8a8_block_fp8_matmul(a_wide[:, :512], a_scale, *quantize_fp8_blocks_ref(w, 128, 128), [128, 128],
                                torch.float32, config=config)
    ref = w8a8_block_fp8_matmul_ref(a, a_scale, *quantize_fp8_blocks_ref(w, 128, 128), [128, 128], torch.float32)
    torch.testing.assert_close(out, ref, **GEMM_TOLERANCES[torch.float32])


@pytest.mark.parametrize("N", [1024, 4096, 6144, 24576])
@pytest.mark.parametrize("M", [1, 16, 64])
def test_decode_tiles_give_every_sm_a_program(M, N):
    """Narrower N tiles until an H200's 132 SMs each have a program (or the narrowest, 32, is reached)."""
    from minivllm.kernels.fp8_gemm import gemm_config

    cfg = gemm_config(M, N, 4096, 128, num_sms=132)
    num_programs = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    assert num_programs >= 132 or cfg["BLOCK_N"] == 32
    assert cfg["BLOCK_N"] == 128 or -(-M // cfg["BLOCK_M"]) * -(-N // (2 * cfg["BLOCK_N"])) < 132  # not narrower than needed
    assert cfg["BLOCK_K"] == 128


def test_block_fp8_gemm_checks_its_arguments():
    x, w = operands(4, 256, 256)
    a, a_scale = per_token_group_quant_fp8_ref(x, 128)
    b, b_scale = quantize_fp8_blocks_ref(w, 128, 128)
    with pytest.raises(AssertionError, match="must be torch.float8_e4m3fn"):
        w8a8_block_fp8_matmul(x, a_scale, b, b_scale, [128, 128])
    with pytest.raises(AssertionError, match="a_scale must be"):
        w8a8_block_fp8_matmul(a, a_scale[:, :1], b, b_scale, [128, 128])
    with pytest.raises(AssertionError, match="b_scale must be"):
        w8a8_block_fp8_matmul(a, a_scale, b, b_scale.t().contiguous()[:1], [128, 128])
    with pytest.raises(AssertionError, match="a must be \\[M, K\\]"):
        w8a8_block_fp8_matmul(a[:, :128], a_scale, b, b_scale, [128, 128])


def test_per_channel_reference_is_the_block_reference_with_whole_rows():
    """Per-token x per-output-channel scales are blocks of [1, K]: one reference for both."""
    x, w = operands(9, 96, 160)
    a, a_scale = per_token_group_quant_fp8_ref(x, 160)
    b, b_scale = quantize_fp8_blocks_ref(w, 1, 160)
    assert a_scale.shape == (9, 1) and b_scale.shape == (96, 1)
    ref = w8a8_block_fp8_matmul_ref(a, a_scale, b, b_scale, [1, 160], torch.float32)
    manual = (a.float() * a_scale) @ (b.float() * b_scale).t()
    torch.testing.assert_close(ref, manual, rtol=1e-6, atol=1e-6)
    assert rel_norm(ref, x @ w.t()) < W8A8_REL_NORM


# ---- the GPU: real shapes in FP8 on the tensor cores ---------------------------------------------

@needs_cuda
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES))
@pytest.mark.parametrize("M", [1, 16, 64, 256, 2048])
def test_gpu_fp8_gemms_at_qwen3_shapes(shape, M):
    N, K = QWEN3_SHAPES[shape]
    x, w = operands(M, N, K)
    x = x.bfloat16()
    # block FP8: the Triton kernel, activation quantization by the Triton kernel
    a, a_scale = per_token_group_quant_fp8(x, 128)
    b, b_scale = quantize_fp8_blocks_ref(w, 128, 128)
    out = w8a8_block_fp8_matmul(a, a_scale, b, b_scale, [128, 128], torch.bfloat16)
    ref = w8a8_block_fp8_matmul_ref(a, a_scale, b, b_scale, [128, 128], torch.float32)
    torch.testing.assert_close(out.float(), ref, **GEMM_TOLERANCES[torch.bfloat16])
    # per-channel FP8: torch._scaled_mm with row-wise scales
    a1, a1_scale = per_token_group_quant_fp8(x, K)
    b1, b1_scale = quantize_fp8_blocks_ref(w, 1, K)
    out1 = scaled_mm_per_channel(a1, a1_scale, b1, b1_scale, torch.bfloat16)
    ref1 = w8a8_block_fp8_matmul_ref(a1, a1_scale, b1, b1_scale, [1, K], torch.float32)
    torch.testing.assert_close(out1.float(), ref1, **GEMM_TOLERANCES[torch.bfloat16])
    unquantized = x.float() @ w.t()
    assert rel_norm(ref, unquantized) < W8A8_REL_NORM and rel_norm(ref1, unquantized) < W8A8_REL_NORM


@needs_cuda
def test_gpu_fp8_kernels_capture_in_a_cuda_graph():
    x, w = operands(64, 1024, 2048)
    x = x.bfloat16()
    b, b_scale = quantize_fp8_blocks_ref(w, 128, 128)

    def linear():
        a, a_scale = per_token_group_quant_fp8(x, 128)
        return w8a8_block_fp8_matmul(a, a_scale, b, b_scale, [128, 128], torch.bfloat16)

    expected = linear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear()
    x.mul_(2)
    graph.replay()
    torch.testing.assert_close(out.float(), 2 * expected.float(), **GEMM_TOLERANCES[torch.bfloat16])


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 13.1 (the rounding's own are in
# tests/test_kernels_fp8.py). A wrong kernel is the copy below with one piece broken, launched where
# per_token_group_quant_fp8 launches the engine's.
# ------------------------------------------------------------------------------------------------

PIECES = ["nothing", "cast_without_a_scale", "no_min_amax", "inverse_scale", "reads_past_the_group"]
NOTHING, CAST_WITHOUT_A_SCALE, NO_MIN_AMAX, INVERSE_SCALE, READS_PAST_THE_GROUP = (
    tl.constexpr(i) for i in range(len(PIECES)))


@triton.jit
def group_quant_with_one_piece_broken(
    x_ptr, codes_ptr, scales_ptr, num_cols, stride_x_m, stride_codes_m, stride_scales_m,
    GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr, BROKEN: tl.constexpr,
):
    """per_token_group_quant_fp8_kernel with the piece BROKEN names broken (NOTHING: none)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, BLOCK)
    if BROKEN == READS_PAST_THE_GROUP:
        mask = cols < num_cols
    else:
        mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x_m + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    if BROKEN != NO_MIN_AMAX:
        amax = tl.maximum(amax, MIN_AMAX)
    if BROKEN == INVERSE_SCALE:
        scale = tl.div_rn(448.0, amax)
    elif BROKEN == CAST_WITHOUT_A_SCALE:  # the trivial answer: codes of x itself, scale 1
        scale = amax * 0.0 + 1.0
    else:
        scale = tl.div_rn(amax, 448.0)
    tl.store(codes_ptr + row * stride_codes_m + cols, quantize_fp8(x, scale), mask=mask)
    tl.store(scales_ptr + row * stride_scales_m + group, scale)


def one_piece_broken(piece: str) -> KernelWithOnePieceBroken:
    """Stands in for the engine's kernel: launches group_quant_with_one_piece_broken with `piece` broken."""
    return KernelWithOnePieceBroken(group_quant_with_one_piece_broken, PIECES, piece)


def check_bit_for_bit():
    test_per_token_group_quant_kernel_is_the_reference_bit_for_bit(torch.float32, 7, 300, 128)


def check_amax_with_groups_of_100():
    test_per_token_group_quant_maps_each_groups_amax_onto_448(300, 100)


@builds_on_the_engine
def test_the_kernel_as_the_wrong_answers_write_it_passes(monkeypatch):
    """The copy with nothing broken is right: each wrong answer below differs from it in one piece."""
    monkeypatch.setattr(fp8_gemm, "per_token_group_quant_fp8_kernel", one_piece_broken("nothing"))
    check_bit_for_bit()
    check_amax_with_groups_of_100()
    test_per_token_group_quant_rounds_every_code_and_midpoint()


@builds_on_the_engine
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # no_min_amax's 0 / 0
@pytest.mark.parametrize("piece, check", [
    ("cast_without_a_scale", check_bit_for_bit),
    ("cast_without_a_scale", test_per_token_group_quant_rounds_every_code_and_midpoint),
    ("no_min_amax", check_bit_for_bit),  # its all-zero group: 0 / 0
    ("inverse_scale", check_amax_with_groups_of_100),
    ("reads_past_the_group", check_amax_with_groups_of_100),
], ids=case_id)
def test_the_activation_checks_reject_a_wrong_kernel(piece, check):
    rejected(check, fp8_gemm, "per_token_group_quant_fp8_kernel", one_piece_broken(piece))
