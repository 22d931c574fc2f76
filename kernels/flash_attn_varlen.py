"""Prefill attention over packed variable-length sequences (FlashAttention-2 style).

One program computes a BLOCK_M x head_dim tile of one query head with an online softmax over
BLOCK_N-key tiles; keys come from contiguous k/v or, for prefix-cache hits, from the paged cache
(an FP8 cache is dequantized in registers as its tiles are loaded: kernels/quant_fp8.py).
vLLM: vllm/attention/ops/triton_unified_attention.py (prefill part); flash-attn: flash_attn_varlen_func.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    check_last_dim_contiguous, default_scale, is_interpreter, reject_unsupported,
)
from .quant_fp8 import check_kv_scale, dequantize_fp8_ref, is_fp8


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
    k_descale=None, v_descale=None,
):
    """Naive reference for `flash_attn_varlen_func`: one sequence at a time, float32 softmax.

    q: [total_q, num_heads, head_dim]. Without block_table, k/v: [total_k, num_kv_heads, head_dim];
    with block_table [batch, max_blocks], k/v are paged caches [num_blocks, block_size,
    num_kv_heads, head_dim] and sequence i's keys are its first cu_seqlens_k[i+1]-cu_seqlens_k[i]
    cached tokens; an FP8 paged cache holds codes, the keys are code * k_descale and the values
    code * v_descale ([1] float32). Returns [total_q, num_heads, head_dim] in q's dtype.
    """
    reject_unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
                       softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                       return_attn_probs=(return_attn_probs, False))
    check_kv_scale("k_descale", k_descale, k)
    check_kv_scale("v_descale", v_descale, v)
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
        if is_fp8(k.dtype):
            k_i, v_i = dequantize_fp8_ref(k_i, k_descale), dequantize_fp8_ref(v_i, v_descale)
        out[cu_q[i]:cu_q[i + 1]] = attention_ref(q_i, k_i, v_i, scale, causal).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernel
#
#   keys ->   0        full_end        end_n     seqlen_k
#   query   +--------+---------------+--------+
#   rows    |  tiles with no mask    |diagonal|  (not visited: masked for every row of the tile)
#   m0..    |  (_attend_kv_range,    | tiles  |
#   m0+BM-1 |   MASKED=False)        | masked |
#           +------------------------+--------+
# Causal alignment is bottom-right: query row i (0-based within its sequence) sees keys
# j <= i + (seqlen_k - seqlen_q), so the new tokens of a prefix-hit prefill see the whole prefix.
# ----------------------------------------------------------------------------------------------
LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads


def prefill_config(head_dim, max_seqlen_q, device):
    """Tile sizes by head_dim and query length: fixed heuristics from the H200 sweep in
    benchmarks/tune_kernels.py (kernels/TUNING.md has the figures)."""
    if device.type != "cuda" or is_interpreter():
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)  # interpreter: few big tiles
    if max_seqlen_q <= 16:
        return PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64 and max_seqlen_q > 64:  # d64: 128x64, 8 warps (8x1024: 256 vs 241 TFLOP/s for 4 warps)
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if max_seqlen_q >= 2048:  # long: big tiles amortize the softmax (1x16384: 476 vs 429 TFLOP/s)
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    # shorter: small tiles, more programs in flight (16x512: 213 TFLOP/s vs 170 for 128x128 w8)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, k_start, seqlen_k, diag, offs_m, offs_d, d_ok, qk_scale, block_size,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Online softmax over keys [start_n, end_n). MASKED tiles apply the causal and length masks;
    unmasked ones (every key visible to every row) skip that work and load without predicates."""
    TILE_MASK: tl.constexpr = MASKED or D_MASK
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seqlen_k
        # Key rows: contiguous, or through the block table (token t is in block_table[t // block_size]).
        if PAGED:
            block_ids = tl.load(block_table_row_ptr + offs_n // block_size, mask=n_ok if MASKED else None)
            k_rows = block_ids.to(tl.int64) * stride_kb + (offs_n % block_size) * stride_kt
            v_rows = block_ids.to(tl.int64) * stride_vb + (offs_n % block_size) * stride_vt
        else:
            k_rows = (k_start + offs_n).to(tl.int64) * stride_kt
            v_rows = (k_start + offs_n).to(tl.int64) * stride_vt
        tile_mask = (n_ok[:, None] & d_ok[None, :]) if TILE_MASK else None
        tile_other = 0.0 if TILE_MASK else None
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :], mask=tile_mask, other=tile_other)
        if KV_FP8:  # FP8 codes -> code * scale, in q's dtype
            k = (k.to(tl.float32) * k_descale).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
        if MASKED:  # a row with no visible key yet keeps m = -inf; subtract 0 to avoid inf - inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=tile_mask, other=tile_other)
        if KV_FP8:
            v = (v.to(tl.float32) * v_descale).to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_attn_varlen_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_table_ptr,
    k_descale_ptr, v_descale_ptr, qk_scale, num_heads, group_size, block_size,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid: (batch * num_heads, cdiv(max_seqlen_q, BLOCK_M)). Query tiles are visited last row
    block first so that the longest (causal) programs start in the first wave."""
    seq = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m0 >= seqlen_q:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    kv_head = head // group_size

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    D_MASK: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    # Which key tiles this row block needs, and which of them need no mask (see diagram).
    diag = seqlen_k - seqlen_q
    if CAUSAL:
        end_n = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + diag), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, m0 + 1 + diag), 0)
    else:
        end_n = seqlen_k
        full_end = seqlen_k
    full_end = (full_end // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    block_table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_descale = 1.0
    v_descale = 1.0
    if KV_FP8:
        k_descale = tl.load(k_descale_ptr)
        v_descale = tl.load(v_descale_ptr)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr,
        0, full_end, k_start, seqlen_k, diag, offs_m, offs_d, d_ok, qk_scale, block_size,
        stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
        BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=False, CAUSAL=CAUSAL, D_MASK=D_MASK, KV_FP8=KV_FP8)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr,
        full_end, end_n, k_start, seqlen_k, diag, offs_m, offs_d, d_ok, qk_scale, block_size,
        stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
        BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=True, CAUSAL=CAUSAL, D_MASK=D_MASK, KV_FP8=KV_FP8)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that see no key at all give zeros, not NaN
    out = acc / l_i[:, None]
    o_rows = (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    o_ptrs = o_ptr + o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    k_descale=None, v_descale=None,
):
    """Triton version of `flash_attn_varlen_ref` (same arguments and layouts).

    max_seqlen_q must be >= every query length (it sizes the grid); max_seqlen_k is unused.
    """
    reject_unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
                       softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                       return_attn_probs=(return_attn_probs, False))
    config = prefill_config(q.shape[-1], max_seqlen_q, q.device)
    return flash_attn_varlen_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    softmax_scale, causal, block_table, config, k_descale, v_descale)


def flash_attn_varlen_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                             causal, block_table, config, k_descale=None, v_descale=None):
    """Check shapes, allocate the output and launch with an explicit PrefillConfig (tuning)."""
    total_q, num_heads, head_dim = q.shape
    paged = block_table is not None
    assert k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k.dim() == (4 if paged else 3), (
        "k/v: [total_k, num_kv_heads, head_dim], or [num_blocks, block_size, num_kv_heads, "
        f"head_dim] with block_table; got {tuple(k.shape)}")
    num_kv_heads = k.shape[-2]
    assert k.shape[-1] == head_dim, f"head_dim of q ({head_dim}) and k ({k.shape[-1]}) differ"
    assert head_dim <= 256, f"head_dim {head_dim} > 256 is not supported"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} KV heads"
    kv_fp8 = is_fp8(k.dtype)
    assert k.dtype == v.dtype and (k.dtype == q.dtype or (kv_fp8 and paged)), (
        f"k/v ({k.dtype}, {v.dtype}) must be q's dtype ({q.dtype}), or FP8 paged caches")
    check_kv_scale("k_descale", k_descale, k)
    check_kv_scale("v_descale", v_descale, v)
    assert q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device
    assert cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.dim() == 1
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32"
    check_last_dim_contiguous(q=q, k=k, v=v)
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        assert block_table.dtype == torch.int32 and block_table.shape[0] == batch, (
            f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}")
        assert block_table.stride(1) == 1, "block_table rows must be contiguous"
        block_size = k.shape[1]
        stride_kb, stride_kt, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vt, stride_vh = v.stride(0), v.stride(1), v.stride(2)
    else:
        block_table = cu_seqlens_k  # unused placeholder pointer (PAGED=False)
        block_size = 1
        stride_kb, stride_kt, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vt, stride_vh = 0, v.stride(0), v.stride(1)

    out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out
    qk_scale = default_scale(head_dim, softmax_scale) * LOG2_E  # softmax with exp2
    grid = (batch * num_heads, triton.cdiv(max_seqlen_q, config.block_m))
    flash_attn_varlen_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_table,
        k_descale if kv_fp8 else q, v_descale if kv_fp8 else q,  # placeholders when KV_FP8 is off
        qk_scale, num_heads, num_heads // num_kv_heads, block_size,
        q.stride(0), q.stride(1), stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        out.stride(0), out.stride(1), block_table.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGED=paged, CAUSAL=causal, KV_FP8=kv_fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
