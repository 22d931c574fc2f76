"""Prefill attention over packed variable-length sequences (FlashAttention-2 style).

vLLM: vllm/attention/ops/triton_unified_attention.py (prefill part); flash-attn:
flash_attn_varlen_func.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels._common import default_scale, reject_unsupported


def _gather_paged(cache, block_table_row, num_tokens):
    """The first `num_tokens` tokens of one sequence from a paged cache.
    cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_blocks].long()]  # [num_blocks, block_size, kvh, d]
    return blocks.flatten(0, 1)[:num_tokens]


def attention_ref(q, k, v, scale, causal):
    """Plain softmax attention for one sequence, in float32.

    q: [seqlen_q, num_heads, head_dim]; k, v: [seqlen_k, num_kv_heads, head_dim].
    Causal alignment is bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q.
    """
    seqlen_q, num_heads, _ = q.shape
    seqlen_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [seqlen_k, num_heads, head_dim]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_heads, seqlen_q, seqlen_k]
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (seqlen_k - seqlen_q), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
    return torch.einsum("hqk,khd->qhd", probs, v)


def flash_attn_varlen_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
):
    """Naive reference for `flash_attn_varlen_func`: one sequence at a time, float32 softmax.

    q: [total_q, num_heads, head_dim]. Without block_table, k/v: [total_k, num_kv_heads, head_dim];
    with block_table [batch, max_blocks], k/v are paged caches [num_blocks, block_size,
    num_kv_heads, head_dim] and sequence i's keys are its first cu_seqlens_k[i+1]-cu_seqlens_k[i]
    cached tokens. Returns [total_q, num_heads, head_dim] in q's dtype.
    """
    reject_unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
                       softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                       return_attn_probs=(return_attn_probs, False))
    scale = default_scale(q.shape[-1], softmax_scale)
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_i = q[cu_q[i]:cu_q[i + 1]]
        seqlen_k = cu_k[i + 1] - cu_k[i]
        if block_table is None:
            k_i, v_i = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            k_i = _gather_paged(k, block_table[i], seqlen_k)
            v_i = _gather_paged(v, block_table[i], seqlen_k)
        out[cu_q[i]:cu_q[i + 1]] = attention_ref(q_i, k_i, v_i, scale, causal).to(q.dtype)
    return out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
):
    """Triton version of `flash_attn_varlen_ref` (same arguments). TODO(kernels helper)."""
    raise NotImplementedError
