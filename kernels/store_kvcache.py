"""Writing new keys and values into the paged KV cache ("reshape_and_cache" in vLLM).

Every new token has a slot = block_id * block_size + offset; slot -1 means "skip" (padding rows of
a CUDA graph). An FP8 cache (float8_e4m3fn) stores each value as its code under a per-tensor scale
(k_scale, v_scale: kernels/quant_fp8.py). vLLM: csrc/cache_kernels.cu (reshape_and_cache_flash).
"""
import torch
import triton
import triton.language as tl

from .quant_fp8 import check_kv_scale, is_fp8, quantize_fp8, quantize_fp8_ref


def store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Naive reference. key/value: [num_tokens, num_kv_heads, head_dim];
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens].
    An FP8 cache stores key / k_scale and value / v_scale (k_scale, v_scale: [1] float32)."""
    check_kv_scale("k_scale", k_scale, k_cache)
    check_kv_scale("v_scale", v_scale, v_cache)
    if is_fp8(k_cache.dtype):
        key, value = quantize_fp8_ref(key, k_scale), quantize_fp8_ref(value, v_scale)
    block_size = k_cache.shape[1]
    stored = slot_mapping >= 0  # -1: skip the row
    slots = slot_mapping[stored].long()
    k_cache[slots // block_size, slots % block_size] = key[stored]  # one indexed write for all tokens
    v_cache[slots // block_size, slots % block_size] = value[stored]


@triton.jit
def store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One program per new token: copy its [num_kv_heads, head_dim] key and value rows to its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_key_t + offs_h * stride_key_h + offs_d, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + offs_h * stride_value_h + offs_d, mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kc_b + block_offset * stride_kc_s + offs_h * stride_kc_h
    v_dst = v_cache_ptr + block_id * stride_vc_b + block_offset * stride_vc_s + offs_h * stride_vc_h
    if KV_FP8:
        key, value = quantize_fp8(key, tl.load(k_scale_ptr)), quantize_fp8(value, tl.load(v_scale_ptr))
    tl.store(k_dst + offs_d, key, mask=mask)
    tl.store(v_dst + offs_d, value, mask=mask)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Triton version of `store_kvcache_ref` (same arguments).

    Never syncs with the host (no .item()), so it can be captured in a CUDA graph.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches: [num_blocks, block_size, kvh, d]"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache heads/dim {tuple(k_cache.shape[2:])} != key's {(num_kv_heads, head_dim)}")
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    assert key.dtype == value.dtype and k_cache.dtype == v_cache.dtype, "key/value or cache dtypes differ"
    kv_fp8 = is_fp8(k_cache.dtype)
    assert kv_fp8 or k_cache.dtype == key.dtype, f"cache {k_cache.dtype}: must be key's {key.dtype} or FP8"
    check_kv_scale("k_scale", k_scale, k_cache)
    check_kv_scale("v_scale", v_scale, v_cache)
    assert key.device == value.device == k_cache.device == v_cache.device == slot_mapping.device
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim"
    slot_mapping = slot_mapping.contiguous()
    if num_tokens == 0:
        return
    store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if kv_fp8 else slot_mapping, v_scale if kv_fp8 else slot_mapping,  # placeholders: unused
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8,
    )
