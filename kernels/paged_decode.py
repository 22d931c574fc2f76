"""Decode attention over the paged KV cache (paged attention / flash-decoding).

vLLM: vllm/attention/ops/triton_decode_attention.py; flash-attn: flash_attn_with_kvcache.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels._common import default_scale, reject_unsupported
from minivllm.kernels.flash_attn_varlen import _gather_paged, attention_ref


def flash_attn_with_kvcache_ref(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    """Naive reference for `flash_attn_with_kvcache`: gather each sequence's keys, then softmax.

    q: [batch, seqlen_q, num_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; cache_seqlens: [batch] int32 (tokens in the cache, the new ones
    included); block_table: [batch, max_blocks] int32. A row with cache_seqlens 0 gives zeros.
    Returns [batch, seqlen_q, num_heads, head_dim].
    """
    reject_unsupported(k=(k, None), v=(v, None), rotary_cos=(rotary_cos, None),
                       cache_batch_idx=(cache_batch_idx, None), cache_leftpad=(cache_leftpad, None),
                       window_size=(tuple(window_size), (-1, -1)), softcap=(softcap, 0.0),
                       alibi_slopes=(alibi_slopes, None), return_softmax_lse=(return_softmax_lse, False))
    if block_table is None or cache_seqlens is None:
        raise ValueError("flash_attn_with_kvcache needs block_table and cache_seqlens (paged cache)")
    scale = default_scale(q.shape[-1], softmax_scale)
    out = torch.empty_like(q)
    for i, seqlen_k in enumerate(cache_seqlens.tolist()):
        k_i = _gather_paged(k_cache, block_table[i], seqlen_k)
        v_i = _gather_paged(v_cache, block_table[i], seqlen_k)
        out[i] = attention_ref(q[i], k_i, v_i, scale, causal).to(q.dtype)
    return out


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    """Triton version of `flash_attn_with_kvcache_ref` (same arguments). TODO(kernels helper)."""
    raise NotImplementedError
