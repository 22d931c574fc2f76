"""Between the QKV projection and attention, in one kernel: per-head RMSNorm of q and k (Qwen3),
rotary embedding of q and k, and the store of the new k and v into the paged KV cache.

Unfused these are five small kernels per layer (q-norm, k-norm, RoPE of q, of k, the cache store);
at decode each moves a few KB and costs its launch. vLLM fuses the same steps in its compiled
graphs and its reshape_and_cache kernels (vllm/compilation/, csrc/pos_encoding_kernels.cu).
An FP8 cache gets the codes of k / k_scale and v / v_scale (kernels/quant_fp8.py).
"""
import torch
import triton
import triton.language as tl

from .quant_fp8 import check_kv_scale, is_fp8, quantize_fp8


def qk_norm_rope_store_ref(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight=None,
                           k_norm_weight=None, eps=1e-6, k_cache=None, v_cache=None, slot_mapping=None,
                           k_scale=None, v_scale=None):
    """Naive reference: the layers' own ops, one after another.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the QKV projection's output;
    positions: [num_tokens] int64; cos_sin_cache: [max_position, head_dim] float32 (cos | sin);
    q_norm_weight/k_norm_weight: [head_dim] or None (no per-head norm); caches: [num_blocks,
    block_size, num_kv_heads, head_dim] or None (store nothing); slot_mapping: [num_tokens], -1 = skip;
    k_scale/v_scale: [1] float32, for an FP8 cache only (see store_kvcache_ref).
    Returns q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim].
    """
    from minivllm.layers.layernorm import rms_norm
    from minivllm.layers.rotary_embedding import apply_rotary

    from .store_kvcache import store_kvcache_ref

    q, k, v = _split_heads(qkv, num_heads, num_kv_heads, cos_sin_cache.shape[-1])
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary(positions, q, k, cos_sin_cache)
    if k_cache is not None:
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k, v


def _split_heads(qkv, num_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


# ----------------------------------------------------------------------------------------------
# One program per token. A head's vector is loaded as its two halves, which is all RoPE's
# "rotate half" layout needs:
#     x = [ lo (d/2) | hi (d/2) ]  ->  [ lo*cos - hi*sin | hi*cos + lo*sin ]   (cos, sin at the position)
# The norm sums squares over both halves. Rounding follows the reference step by step (normalize
# in fp32, round, scale by the weight, round; rotate in fp32, round), so results agree to an ulp.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _head_offsets(num_heads, NUM_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Offsets of the lower halves of `num_heads` contiguous heads, and their mask."""
    offs_h = tl.arange(0, NUM_HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    return offs_h * (2 * HALF) + offs_d, (offs_h < num_heads) & (offs_d < HALF)


@triton.jit
def _norm_rope_heads(src_ptr, weight_ptr, cos, sin, eps, num_heads,
                     NUM_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     NORM: tl.constexpr):
    """Load `num_heads` contiguous heads, normalize them (if NORM) and rotate them: (lo, hi)."""
    offs, mask = _head_offsets(num_heads, NUM_HEADS_PAD, HALF, HALF_PAD)
    lo = tl.load(src_ptr + offs, mask=mask, other=0.0)
    hi = tl.load(src_ptr + HALF + offs, mask=mask, other=0.0)
    dtype = lo.dtype
    if NORM:
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        mean_sq = (tl.sum(lo32 * lo32, 1) + tl.sum(hi32 * hi32, 1)) / (2 * HALF)
        inv_rms = (1.0 / tl.sqrt(mean_sq + eps))[:, None]
        offs_d = tl.arange(0, HALF_PAD)[None, :]
        w_lo = tl.load(weight_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        w_hi = tl.load(weight_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        lo = (w_lo * (lo32 * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        hi = (w_hi * (hi32 * inv_rms).to(dtype).to(tl.float32)).to(dtype)
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    return (lo32 * cos - hi32 * sin).to(dtype), (hi32 * cos + lo32 * sin).to(dtype)


@triton.jit
def _store_heads(dst_ptr, lo, hi, num_heads, NUM_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    offs, mask = _head_offsets(num_heads, NUM_HEADS_PAD, HALF, HALF_PAD)
    tl.store(dst_ptr + offs, lo, mask=mask)
    tl.store(dst_ptr + HALF + offs, hi, mask=mask)


@triton.jit
def qk_norm_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, eps, num_heads, num_kv_heads, block_size,
    stride_qkv_t, stride_cos_sin, stride_kc_b, stride_kc_s, stride_vc_b, stride_vc_s,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr, KV_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + offs_d, mask=offs_d < HALF, other=0.0)
    head_dim = 2 * HALF
    q_src = qkv_ptr + token * stride_qkv_t
    k_src = q_src + num_heads * head_dim
    v_src = k_src + num_kv_heads * head_dim
    q_lo, q_hi = _norm_rope_heads(q_src, q_weight_ptr, cos, sin, eps, num_heads,
                                  NUM_HEADS_PAD=HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD, NORM=NORM)
    _store_heads(q_out_ptr + token * num_heads * head_dim, q_lo, q_hi, num_heads,
                 NUM_HEADS_PAD=HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)
    k_lo, k_hi = _norm_rope_heads(k_src, k_weight_ptr, cos, sin, eps, num_kv_heads,
                                  NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD, NORM=NORM)
    _store_heads(k_out_ptr + token * num_kv_heads * head_dim, k_lo, k_hi, num_kv_heads,
                 NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, nothing to store
            block, offset = slot // block_size, slot % block_size
            offs, mask = _head_offsets(num_kv_heads, KV_HEADS_PAD, HALF, HALF_PAD)
            v_lo, v_hi = tl.load(v_src + offs, mask=mask), tl.load(v_src + HALF + offs, mask=mask)
            k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s
            v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s
            # (FP8 codes go to the store directly: compiled Triton refuses a variable that changes
            # type inside an `if`, which the interpreter allows.)
            if KV_FP8:
                k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
                _store_heads(k_dst, quantize_fp8(k_lo, k_scale), quantize_fp8(k_hi, k_scale), num_kv_heads,
                             NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)
                _store_heads(v_dst, quantize_fp8(v_lo, v_scale), quantize_fp8(v_hi, v_scale), num_kv_heads,
                             NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)
            else:
                _store_heads(k_dst, k_lo, k_hi, num_kv_heads, NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)
                _store_heads(v_dst, v_lo, v_hi, num_kv_heads, NUM_HEADS_PAD=KV_HEADS_PAD, HALF=HALF, HALF_PAD=HALF_PAD)


def qk_norm_rope_store(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, q_norm_weight=None,
                       k_norm_weight=None, eps=1e-6, k_cache=None, v_cache=None, slot_mapping=None,
                       k_scale=None, v_scale=None):
    """Triton version of `qk_norm_rope_store_ref` (same arguments and results). Never syncs with
    the host, so it can be captured in a CUDA graph."""
    num_tokens = qkv.shape[0]
    head_dim = cos_sin_cache.shape[-1]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] = [*, "
        f"{(num_heads + 2 * num_kv_heads) * head_dim}], got {tuple(qkv.shape)}")
    assert qkv.stride(1) == 1, "qkv rows must be contiguous"
    assert head_dim % 2 == 0, f"RoPE needs an even head_dim, got {head_dim}"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)} != ({num_tokens},)"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1, "cos_sin_cache: float32 rows"
    norm = q_norm_weight is not None
    assert norm == (k_norm_weight is not None), "give both q_norm_weight and k_norm_weight, or neither"
    if norm:
        assert q_norm_weight.shape == k_norm_weight.shape == (head_dim,), "norm weights: [head_dim]"
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    store = k_cache is not None
    if store:
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (
            f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(k_cache.shape)}")
        assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1 and v_cache.stride()[2:] == (head_dim, 1)
        assert k_cache.dtype == v_cache.dtype and (k_cache.dtype == qkv.dtype or is_fp8(k_cache.dtype)), (
            f"cache dtype {k_cache.dtype}: must be qkv's {qkv.dtype} or FP8")
        check_kv_scale("k_scale", k_scale, k_cache)
        check_kv_scale("v_scale", v_scale, v_cache)
        assert slot_mapping is not None and slot_mapping.shape == (num_tokens,), "slot_mapping: [num_tokens]"
    kv_fp8 = store and is_fp8(k_cache.dtype)
    _, _, v = _split_heads(qkv, num_heads, num_kv_heads, head_dim)
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q, k, v
    half = head_dim // 2
    qk_norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, cos_sin_cache, q_norm_weight if norm else cos_sin_cache,
        k_norm_weight if norm else cos_sin_cache, q, k,
        k_cache if store else q, v_cache if store else q, slot_mapping if store else positions,
        k_scale if kv_fp8 else cos_sin_cache, v_scale if kv_fp8 else cos_sin_cache,  # placeholders: unused
        eps, num_heads, num_kv_heads, k_cache.shape[1] if store else 1,
        qkv.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0) if store else 0, k_cache.stride(1) if store else 0,
        v_cache.stride(0) if store else 0, v_cache.stride(1) if store else 0,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), NORM=norm, STORE=store, KV_FP8=kv_fp8,
    )
    return q, k, v
