"""The FP8 KV cache in the kernels: quantize/dequantize round trips, the store kernels writing FP8
codes, and the decode and prefix-hit prefill kernels reading them, each against its reference
(which dequantizes explicitly) and against attention over the unquantized cache; the decode kernel's
two code conversions (fp8_convert "cvt" / "bits") and its dots' row padding (min_block_m).

The Triton interpreter (triton 3.9) loads and stores float8_e4m3fn, so these run on the CPU too.
The scale and the rounding's tests grade exercise 13.1 with the activation quantization's in
tests/test_kernels_fp8_gemm.py; the known wrong scales and roundings at the end must fail them.
"""
import sys
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from conftest_kernels import (  # noqa: I001
    DEVICE, ON_GPU, assert_close, cu_seqlens, needs_cuda, needs_interpreter, paged_cache, randn,
)
from minivllm.kernels import (
    flash_attn_varlen_func, flash_attn_varlen_ref, flash_attn_with_kvcache, flash_attn_with_kvcache_ref,
    qk_norm_rope_store, qk_norm_rope_store_ref, store_kvcache, store_kvcache_ref,
)
from minivllm.kernels.paged_decode import (
    E4M3_BITS_FACTOR, DecodeConfig, decode_config, decode_num_splits, e4m3_bits_to_fp16, paged_decode_launch,
)
from minivllm.kernels.quant_fp8 import (
    FP8_DTYPE, FP8_MAX, dequantize_fp8_ref, kv_scale_from_amax, quantize_fp8, quantize_fp8_ref,
)
from minivllm.layers.rotary_embedding import RotaryEmbedding
from wrong_answers import builds_on_the_engine, case_id, rejected

# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value (normal
# range). Attention over such keys and values moves the output by a few percent (relative norm of
# the error; single elements can move more where the softmax is peaked).
FP8_REL_ERROR = 2.0**-4
ATTENTION_FP8_REL_NORM = 0.05


def _scale(value):
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)


def assert_fp8_close(actual, unquantized):
    """Attention over an FP8 cache vs over the unquantized one: relative error norm."""
    error = (actual.float() - unquantized.float()).norm() / unquantized.float().norm()
    assert error < ATTENTION_FP8_REL_NORM, f"relative error {error:.3f}"
    return error


def _as_fp8_cache(cache):
    """An FP8 copy of a cache with the amax scale (as calculate_kv_scales would pick)."""
    scale = kv_scale_from_amax(cache)
    return quantize_fp8_ref(cache, scale), scale


# ---- quantize / dequantize -------------------------------------------------------------------

def test_round_trip_error_is_within_half_an_fp8_step():
    x = randn(4096, dtype=torch.float32) * 3
    x[:64] *= 1e-4  # some values in e4m3's subnormal range
    scale = kv_scale_from_amax(x)
    back = dequantize_fp8_ref(quantize_fp8_ref(x, scale), scale)
    normal = x.abs() >= scale * 2.0**-6  # below this e4m3 is subnormal: absolute error instead
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= FP8_REL_ERROR + 1e-7
    assert (~normal).any() and (back - x)[~normal].abs().max() <= scale * 2.0**-10
    assert back.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)  # amax maps onto 448 exactly


def test_representable_values_survive_and_large_ones_saturate():
    scale = _scale(0.5)
    exact = torch.tensor([0.0, 1.0, -1.5, 448.0 * 0.5, 2.0**-9 * 0.5, -0.875], device=DEVICE)
    assert torch.equal(dequantize_fp8_ref(quantize_fp8_ref(exact, scale), scale), exact)
    huge = torch.tensor([1e6, -1e6, float(FP8_MAX)], device=DEVICE)
    codes = quantize_fp8_ref(huge, scale)
    assert codes.dtype == FP8_DTYPE and not codes.float().isnan().any()
    assert codes.float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert kv_scale_from_amax(torch.zeros(3, device=DEVICE)).item() == 1.0


def test_kv_scale_maps_the_amax_onto_448_on_the_device():
    """kv_scale_from_amax: [1] float32 on x's device, the largest magnitude (here a negative value) over
    448, so that it lands on the code -448; 1.0 for an all-zero tensor; on a GPU, no host sync."""
    x = randn(7, 300, dtype=torch.bfloat16) * 3
    x[3, 17] = -40.0
    sync_mode = torch.cuda.get_sync_debug_mode() if ON_GPU else None
    if ON_GPU:
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing op raises
    try:
        scale = kv_scale_from_amax(x)
        zero_scale = kv_scale_from_amax(torch.zeros(5, device=DEVICE))
    except RuntimeError as e:  # what sync debug mode raises on a GPU: a failed check, with the reason
        if "synchronizing" not in str(e):
            raise
        raise AssertionError("kv_scale_from_amax synced with the host (.item(), .tolist(), a Python float): "
                             "keep the scale a [1] tensor on x's device") from e
    finally:
        if ON_GPU:
            torch.cuda.set_sync_debug_mode(sync_mode)
    assert isinstance(scale, torch.Tensor) and scale.shape == (1,) and scale.dtype == torch.float32
    assert scale.device == x.device and zero_scale.device == x.device
    assert scale.item() == pytest.approx(40.0 / FP8_MAX, rel=1e-6)
    assert zero_scale.tolist() == [1.0]
    assert quantize_fp8_ref(x, scale).float().min().item() == -FP8_MAX


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, quantize_fp8(tl.load(x_ptr + offs), tl.load(scale_ptr)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_kernel_quantize_matches_torch_bit_for_bit(dtype, scale):
    """Every e4m3 value, every midpoint between neighbours (ties go to even) and the floats just
    beside each midpoint, both signs and zeros, out-of-range values, and random ones."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, torch.tensor([-0.0, 1e6, -1e6, 449.0, -500.0]), mids,
                   mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)), torch.randn(1500) * 50])
    n = triton.next_power_of_2(len(x))
    x = (torch.cat([x, torch.zeros(n - len(x))]) * scale).to(dtype).to(DEVICE)
    scale_t = _scale(scale)
    codes = torch.empty(n, dtype=FP8_DTYPE, device=DEVICE)
    _quantize_kernel[(1,)](x, scale_t, codes, N=n)
    assert torch.equal(codes.view(torch.uint8), quantize_fp8_ref(x, scale_t).view(torch.uint8))


@triton.jit
def _e4m3_bits_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3_bits_to_fp16(tl.load(codes_ptr + offs)))


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_bit_conversion_is_exact_for_every_code(scale):
    """e4m3_bits_to_fp16 on all 256 bytes: 2^-8 times each code's value, so with the factor folded
    into the scale (one multiply by scale * 2^8, as the decode kernel does) exactly the reference's
    code * scale; -0.0 keeps its sign; the two NaN codes read +-1.875 (+-480 after the factor)."""
    assert E4M3_BITS_FACTOR.value == 2.0 ** (15 - 7)  # fp16's exponent bias over e4m3's
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    bits = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _e4m3_bits_kernel[(1,)](codes, bits, N=256)
    values = codes.view(FP8_DTYPE).float()
    nan = values.isnan()
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(bits.float()[~nan] * 2.0**8, values[~nan])
    scale_t = _scale(scale)
    folded = bits.float() * (scale_t * 2.0**8)
    assert torch.equal(folded[~nan], dequantize_fp8_ref(codes.view(FP8_DTYPE), scale_t)[~nan])
    assert torch.equal(folded.signbit(), codes >= 0x80)  # 0x80 is -0.0
    assert bits.float()[nan].tolist() == [1.875, -1.875]


# ---- the store kernels -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kvcache_writes_the_reference_codes(dtype, block_size):
    num_tokens, num_kv_heads, head_dim, num_blocks = 29, 2, 64, 64 // block_size + 2
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype) * 4
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0], dtype=dtype)  # saturates at +-448 codes
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    drop = torch.rand(num_tokens) < 0.2
    drop[0] = False
    slots[drop] = -1
    slot_mapping = slots.to(torch.int32).to(DEVICE)
    k_scale, v_scale = _scale(0.02), _scale(0.005)
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=DEVICE)
              for _ in range(4)]
    store_kvcache(key, value, caches[0], caches[1], slot_mapping, k_scale, v_scale)
    store_kvcache_ref(key, value, caches[2], caches[3], slot_mapping, k_scale, v_scale)
    # Bit-exact: the kernel divides with IEEE rounding and rounds to nearest like the reference.
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    stored = caches[0].flatten(0, 1)[slots[0], 0, :3].float()
    assert stored.tolist() == [FP8_MAX, -FP8_MAX, 0.0]


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_store_writes_fp8(norm):
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 11, 4, 2, 64, 4
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32)
    positions = torch.randint(0, 4000, (num_tokens,), device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(DEVICE)
    weights = [1 + 0.1 * randn(head_dim, dtype=torch.float32) for _ in range(2)] if norm else [None, None]
    slots = torch.randperm(8 * block_size)[:num_tokens].to(DEVICE)
    slots[1] = -1
    caches = [torch.zeros(8, block_size, num_kv_heads, head_dim, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    scales = dict(k_scale=_scale(0.01), v_scale=_scale(0.007))
    args = (qkv, positions, cos_sin, num_heads, num_kv_heads, *weights, 1e-6)
    _, k, v = qk_norm_rope_store(*args, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, **scales)
    _, k_ref, v_ref = qk_norm_rope_store_ref(*args, k_cache=caches[2], v_cache=caches[3], slot_mapping=slots, **scales)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))  # v is copied, not computed
    # k may differ from the reference by an fp32 ulp, which can flip a code at a rounding boundary.
    torch.testing.assert_close(caches[0].float(), caches[2].float(), atol=2.0**-9, rtol=2.0**-3)
    assert (caches[0].view(torch.uint8) == caches[2].view(torch.uint8)).float().mean() > 0.99


# ---- the attention kernels read FP8 ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size, num_splits", [(16, 1), (4, 3)])
def test_decode_reads_fp8(dtype, block_size, num_splits):
    context_lens = [0, 1, 7, 17, 120]
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, 2, 64, dtype)
    k_fp8, k_scale = _as_fp8_cache(k_cache * 3)
    v_fp8, v_scale = _as_fp8_cache(v_cache)
    q = randn(len(context_lens), 1, 8, 64, dtype=dtype)
    args = dict(cache_seqlens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
                block_table=block_table, num_splits=num_splits)
    actual = flash_attn_with_kvcache(q, k_fp8, v_fp8, k_descale=k_scale, v_descale=v_scale, **args)
    expected = flash_attn_with_kvcache_ref(q, k_fp8, v_fp8, k_descale=k_scale, v_descale=v_scale, **args)
    assert_close(actual, expected)  # same dequantized inputs: the usual kernel tolerance
    unquantized = flash_attn_with_kvcache_ref(q, k_cache * 3, v_cache, **args)
    assert_fp8_close(actual, unquantized)
    assert torch.equal(actual[0], torch.zeros_like(actual[0]))


def _fp8_decode_case(context_lens, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """q, FP8 caches (keys scaled up 3x before quantizing) with their scales, seqlens, block table."""
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    (k_fp8, k_scale), (v_fp8, v_scale) = _as_fp8_cache(k_cache * 3), _as_fp8_cache(v_cache)
    q = randn(len(context_lens), 1, num_heads, head_dim, dtype=dtype)
    seqlens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return q, k_fp8, v_fp8, seqlens, block_table, k_scale, v_scale


def _check_fp8_variants(case, base, num_splits):
    """Each (min_block_m, fp8_convert) against the reference; "bits" equal to "cvt" bit for bit at
    the same row padding (the 2^8 is a power of two: folding it into the scales rounds nothing)."""
    q, k_fp8, v_fp8, seqlens, block_table, k_scale, v_scale = case
    expected = flash_attn_with_kvcache_ref(q, k_fp8, v_fp8, cache_seqlens=seqlens, block_table=block_table,
                                           k_descale=k_scale, v_descale=v_scale)
    for rows in (16, 64):
        outs = {}
        for convert in ("cvt", "bits"):
            config = replace(base, fp8_convert=convert, min_block_m=rows)
            outs[convert] = paged_decode_launch(q, k_fp8, v_fp8, seqlens, block_table, None, True, num_splits,
                                                config, None, k_scale, v_scale)
            assert_close(outs[convert], expected)
        assert torch.equal(outs["bits"], outs["cvt"]), f"min_block_m {rows}: bits and cvt differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_decode_fp8_conversions_and_row_padding(dtype, group_size):
    case = _fp8_decode_case([0, 1, 7, 17, 120], 4, 2 * group_size, 2, 64, dtype)
    base = DecodeConfig(block_n=16, num_warps=4, num_stages=1, programs_per_sm=2, min_split_tokens=16)
    _check_fp8_variants(case, base, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_hit_prefill_reads_fp8(dtype, block_size):
    """The cached prefix of a prefix hit is FP8; the new tokens' keys are the model's dtype."""
    new_lens, cached_lens = [1, 7, 17, 40], [0, 33, 16, 5]
    context_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, 2, 64, dtype)
    k_fp8, k_scale = _as_fp8_cache(k_cache)
    v_fp8, v_scale = _as_fp8_cache(v_cache * 2)
    q = randn(sum(new_lens), 4, 64, dtype=dtype)
    k, v = randn(sum(new_lens), 2, 64, dtype=dtype), randn(sum(new_lens), 2, 64, dtype=dtype)
    args = (q, k, v, cu_seqlens(new_lens), cu_seqlens(context_lens), max(new_lens), max(context_lens))
    kwargs = dict(causal=True, block_table=block_table, k_descale=k_scale, v_descale=v_scale)
    actual = flash_attn_varlen_func(*args, k_cache=k_fp8, v_cache=v_fp8, **kwargs)
    assert_close(actual, flash_attn_varlen_ref(*args, k_cache=k_fp8, v_cache=v_fp8, **kwargs))
    unquantized = flash_attn_varlen_ref(*args, causal=True, block_table=block_table, k_cache=k_cache,
                                        v_cache=v_cache * 2)
    assert_fp8_close(actual, unquantized)


# ---- clear errors ----------------------------------------------------------------------------

def test_scale_arguments_are_checked():
    k_cache, v_cache, block_table = paged_cache([5], 4, 2, 64, torch.float32)
    k_fp8, scale = _as_fp8_cache(k_cache)
    q = randn(1, 1, 4, 64, dtype=torch.float32)
    args = dict(cache_seqlens=torch.tensor([5], dtype=torch.int32, device=DEVICE), block_table=block_table)
    with pytest.raises(AssertionError, match="needs k_descale"):
        flash_attn_with_kvcache(q, k_fp8, k_fp8, **args)
    with pytest.raises(AssertionError, match="only for an FP8 cache"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=scale, v_descale=scale, **args)
    with pytest.raises(AssertionError, match=r"\[1\] float32"):
        flash_attn_with_kvcache(q, k_fp8, k_fp8, k_descale=scale.double(), v_descale=scale, **args)
    with pytest.raises(AssertionError, match="FP8"):  # a cache of another dtype than q's or FP8
        flash_attn_with_kvcache(q, k_cache.half(), v_cache.half(), **args)
    key = randn(2, 2, 64, dtype=torch.float32)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="needs k_scale"):
        store_kvcache(key, key, k_fp8, k_fp8.clone(), slots)
    with pytest.raises(AssertionError, match="needs k_scale"):
        store_kvcache_ref(key, key, k_fp8, k_fp8.clone(), slots)
    with pytest.raises(AssertionError, match="FP8 paged cache"):  # contiguous keys are never FP8
        cu = cu_seqlens([2])
        flash_attn_varlen_func(key.repeat(1, 2, 1), key.to(FP8_DTYPE), key.to(FP8_DTYPE), cu, cu, 2, 2,
                               k_descale=scale, v_descale=scale)


# ---- the GPU at realistic sizes --------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("batch, context", [(8, 32768), (64, 4096)])
def test_decode_fp8_realistic_gpu(batch, context):
    k_cache, v_cache, block_table = paged_cache([context] * batch, 16, 8, 128, torch.bfloat16)
    k_fp8, k_scale = _as_fp8_cache(k_cache)
    v_fp8, v_scale = _as_fp8_cache(v_cache)
    q = randn(batch, 1, 16, 128, dtype=torch.bfloat16)
    args = dict(cache_seqlens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE), block_table=block_table)
    actual = flash_attn_with_kvcache(q, k_fp8, v_fp8, k_descale=k_scale, v_descale=v_scale, **args)
    assert_close(actual, flash_attn_with_kvcache_ref(q, k_fp8, v_fp8, k_descale=k_scale, v_descale=v_scale, **args))
    unquantized = flash_attn_with_kvcache_ref(q, k_cache, v_cache, **args)
    assert_fp8_close(actual, unquantized)


@needs_cuda
@pytest.mark.parametrize("batch, max_context, num_heads", [(8, 32768, 16), (64, 4096, 16), (48, 2000, 32)])
def test_decode_fp8_conversions_realistic_gpu(batch, max_context, num_heads):
    """bf16 queries (dots in fp16), ragged contexts, the engine's block size and split count."""
    context_lens = torch.randint(1, max_context + 1, (batch,)).tolist()
    context_lens[0], context_lens[1] = max_context, 0
    case = _fp8_decode_case(context_lens, 16, num_heads, 8, 128, torch.bfloat16)
    base = decode_config(128, DEVICE)
    _check_fp8_variants(case, base, decode_num_splits(batch, 8, case[4].shape[1] * 16, DEVICE, base))


@needs_cuda
def test_store_fp8_large_gpu():
    num_tokens = 8192
    key = randn(num_tokens, 8, 128, dtype=torch.bfloat16) * 5
    value = randn(num_tokens, 8, 128, dtype=torch.bfloat16)
    slot_mapping = torch.randperm(1024 * 16, device=DEVICE)[:num_tokens].to(torch.int64)
    k_scale, v_scale = kv_scale_from_amax(key), kv_scale_from_amax(value)
    caches = [torch.zeros(1024, 16, 8, 128, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    store_kvcache(key, value, caches[0], caches[1], slot_mapping, k_scale, v_scale)
    store_kvcache_ref(key, value, caches[2], caches[3], slot_mapping, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunk_continuing_an_fp8_prefix(block_size):
    """minivllm's layout: the cached prefix is FP8 in the paged cache, the new tokens' keys come
    unquantized from the projection (k/v packed like q)."""
    new_lens, cached_lens = [1, 9, 30], [16, 33, 5]
    context_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    k_cache, v_cache, block_table = paged_cache(context_lens, block_size, 2, 64, torch.float32)
    k_fp8, k_scale = _as_fp8_cache(k_cache)
    v_fp8, v_scale = _as_fp8_cache(v_cache)
    q = randn(sum(new_lens), 4, 64, dtype=torch.float32)
    k_new, v_new = randn(sum(new_lens), 2, 64, dtype=torch.float32), randn(sum(new_lens), 2, 64, dtype=torch.float32)
    args = (q, k_new, v_new, cu_seqlens(new_lens), cu_seqlens(context_lens), max(new_lens), max(context_lens))
    kwargs = dict(causal=True, block_table=block_table, k_cache=k_fp8, v_cache=v_fp8, k_descale=k_scale, v_descale=v_scale)
    actual = flash_attn_varlen_func(*args, **kwargs)
    assert_close(actual, flash_attn_varlen_ref(*args, **kwargs))
    unquantized = flash_attn_varlen_ref(*args, causal=True, block_table=block_table, k_cache=k_cache, v_cache=v_cache)
    assert_fp8_close(actual, unquantized)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 13.1 (the activation kernel's are in
# tests/test_kernels_fp8_gemm.py). The checks call kv_scale_from_amax and quantize_fp8 through this
# module's names.
# ------------------------------------------------------------------------------------------------

def scale_of_the_largest_value(x):
    """amax of x, not of |x|: a tensor whose extreme is negative saturates."""
    amax = x.detach().amax().float().reshape(1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def scale_without_the_zero_guard(x):
    """An all-zero tensor gets scale 0: its codes are 0 / 0."""
    return x.detach().abs().amax().float().reshape(1) / FP8_MAX


def scale_as_a_python_number(x):
    """.item(): a host sync in every step that calls it, and not the [1] tensor the kernels read."""
    return (x.detach().abs().amax().item() or FP8_MAX) / FP8_MAX


ROUNDINGS = ["nothing", "no_saturation", "ties_away_from_zero", "truncation", "no_subnormal_step"]
NOTHING, NO_SATURATION, TIES_AWAY_FROM_ZERO, TRUNCATION, NO_SUBNORMAL_STEP = (
    tl.constexpr(i) for i in range(len(ROUNDINGS)))


@triton.jit
def _quantize_with_one_piece_broken(x, scale, BROKEN: tl.constexpr):
    """quantize_fp8 with the piece BROKEN names broken (NOTHING: none)."""
    y = tl.div_rn(x.to(tl.float32), scale)
    if BROKEN != NO_SATURATION:
        y = tl.clamp(y, -448.0, 448.0)
    bits = y.to(tl.int32, bitcast=True)
    if BROKEN == TIES_AWAY_FROM_ZERO:
        normal = (bits + 0x80000) & -0x100000
    elif BROKEN == TRUNCATION:
        normal = bits & -0x100000
    else:
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = normal.to(tl.float32, bitcast=True)
    subnormal = (tl.abs(y) + 24576.0) - 24576.0
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    if BROKEN == NO_SUBNORMAL_STEP:
        rounded = normal
    else:
        rounded = tl.where(tl.abs(y) < 0.015625, subnormal, normal)
    return rounded.to(tl.float8e4nv)


@triton.jit
def quantize_as_the_wrong_answers_write_it(x, scale):
    return _quantize_with_one_piece_broken(x, scale, NOTHING)


@triton.jit
def quantize_without_saturation(x, scale):
    return _quantize_with_one_piece_broken(x, scale, NO_SATURATION)


@triton.jit
def quantize_with_ties_away_from_zero(x, scale):
    return _quantize_with_one_piece_broken(x, scale, TIES_AWAY_FROM_ZERO)


@triton.jit
def quantize_by_truncation(x, scale):
    return _quantize_with_one_piece_broken(x, scale, TRUNCATION)


@triton.jit
def quantize_without_the_subnormal_step(x, scale):
    return _quantize_with_one_piece_broken(x, scale, NO_SUBNORMAL_STEP)


def check_every_code(scale=0.37):
    test_kernel_quantize_matches_torch_bit_for_bit(torch.float32, scale)


def check_the_kv_scale():
    test_kv_scale_maps_the_amax_onto_448_on_the_device()


@pytest.fixture
def fresh_quantize_kernel(monkeypatch):
    """A new copy of _quantize_kernel, so that a compiled one cannot keep the right quantize_fp8 (GPU)."""
    monkeypatch.setattr(sys.modules[__name__], "_quantize_kernel", triton.jit(_quantize_kernel.fn))


@builds_on_the_engine
def test_the_rounding_as_the_wrong_answers_write_it_passes(fresh_quantize_kernel, monkeypatch):
    """With nothing broken it is right: each wrong rounding below differs from it in one piece."""
    monkeypatch.setattr(sys.modules[__name__], "quantize_fp8", quantize_as_the_wrong_answers_write_it)
    check_every_code(1.0)
    check_every_code(0.37)


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("kv_scale_from_amax", scale_of_the_largest_value, check_the_kv_scale),
    ("kv_scale_from_amax", scale_without_the_zero_guard, check_the_kv_scale),
    ("kv_scale_from_amax", scale_as_a_python_number, check_the_kv_scale),
    # A GPU's cast saturates by itself (cvt.rn.satfinite); the interpreter's does not.
    pytest.param("quantize_fp8", quantize_without_saturation, check_every_code, marks=needs_interpreter),
    ("quantize_fp8", quantize_with_ties_away_from_zero, check_every_code),
    ("quantize_fp8", quantize_by_truncation, check_every_code),
    ("quantize_fp8", quantize_without_the_subnormal_step, check_every_code),
], ids=case_id)
def test_the_fp8_checks_reject_a_wrong_scale_or_rounding(name, wrong, check, fresh_quantize_kernel):
    rejected(check, sys.modules[__name__], name, wrong)
