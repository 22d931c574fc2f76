"""Prefill attention over packed variable-length sequences (FlashAttention-2 style).

One program computes a BLOCK_M x head_dim tile of one query head with an online softmax over
BLOCK_N-key tiles. Keys come from contiguous k/v, or, when a prompt continues a cached prefix (a
prefix-cache hit, or the next chunk of a chunked prefill), the prefix comes from the paged cache
and the new tokens' keys from contiguous k/v. An FP8 cache is dequantized in registers as its
tiles are loaded (kernels/quant_fp8.py); the new tokens' keys are never quantized.
vLLM: vllm/attention/ops/triton_unified_attention.py (prefill part); flash-attn: flash_attn_varlen_func.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2_E, check_last_dim_contiguous, default_scale, is_interpreter, reject_unsupported,
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


def _check_cache_layout(block_table, k_cache, v_cache):
    """A block_table comes with k_cache/v_cache holding each sequence's cached prefix."""
    if (block_table is None) != (k_cache is None) or (k_cache is None) != (v_cache is None):
        raise NotImplementedError("pass block_table, k_cache and v_cache together (the cached prefix) or none "
                                  "of them; flash-attn's layout with every key in paged k/v is not supported")


def _dequantize(cached, descale):
    """Cached keys or values as numbers: FP8 codes times their scale, float32; others as they are."""
    return cached if descale is None else dequantize_fp8_ref(cached, descale)


def flash_attn_varlen_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    k_cache=None, v_cache=None, k_descale=None, v_descale=None,
):
    """Naive reference for `flash_attn_varlen_func`: one sequence at a time, float32 softmax.

    q: [total_q, num_heads, head_dim]; sequence i has cu_seqlens_k[i+1]-cu_seqlens_k[i] keys.
    Where the keys are:
      - no block_table: k/v [total_k, num_kv_heads, head_dim], packed by cu_seqlens_k;
      - block_table [batch, max_blocks] with k_cache/v_cache (a prompt continuing a cached prefix):
        the first seqlen_k - seqlen_q keys of each sequence are in the paged caches [num_blocks,
        block_size, num_kv_heads, head_dim], and k/v [total_q, num_kv_heads, head_dim] are the new
        tokens' keys, packed like q. (flash-attn's other layout, every key in the caches passed as
        k/v, is not supported.)
    An FP8 paged cache holds codes: its keys are code * k_descale and its values code * v_descale
    ([1] float32). Returns [total_q, num_heads, head_dim] in q's dtype.
    """
    reject_unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
                       softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                       return_attn_probs=(return_attn_probs, False))
    _check_cache_layout(block_table, k_cache, v_cache)
    if k_cache is None:
        assert not is_fp8(k.dtype) and k_descale is None and v_descale is None, "contiguous k/v are never FP8"
    else:
        check_kv_scale("k_descale", k_descale, k_cache)
        check_kv_scale("v_descale", v_descale, v_cache)
    scale = default_scale(q.shape[-1], softmax_scale)
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_i = q[cu_q[i]:cu_q[i + 1]]
        seqlen_k = cu_k[i + 1] - cu_k[i]
        if block_table is None:
            k_i, v_i = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            num_prefix = seqlen_k - len(q_i)
            k_i = torch.cat([_dequantize(_gather_paged(k_cache, block_table[i], num_prefix), k_descale).to(q.dtype),
                             k[cu_q[i]:cu_q[i + 1]]])
            v_i = torch.cat([_dequantize(_gather_paged(v_cache, block_table[i], num_prefix), v_descale).to(q.dtype),
                             v[cu_q[i]:cu_q[i + 1]]])
        out[cu_q[i]:cu_q[i + 1]] = attention_ref(q_i, k_i, v_i, scale, causal).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernel
#
#   keys ->   0          paged_len                  full_end     end_n      seqlen_k
#   query   +----------------+------------------------+----------+--------+
#   rows    | phase 1: paged | phase 2: contiguous    |diagonal  |  (not visited: masked
#   m0..    | prefix, full   | new keys, full tiles   |tiles,    |   for every row of
#   m0+BM-1 | tiles unmasked | unmasked               |masked    |   the tile)
#           +----------------+------------------------+----------+--------+
#
# Causal alignment is bottom-right: query row i (0-based within its sequence) sees keys
# j <= i + (seqlen_k - seqlen_q), so a prompt that continues a cached prefix sees the whole
# prefix. Where the keys live decides paged_len:
#   - all keys contiguous (no block_table):                       paged_len = 0
#   - prefix in the paged cache, new keys contiguous (k_cache):   paged_len = seqlen_k - seqlen_q
#     Every query sees every prefix key, so phase 1 is unmasked full tiles plus at most one tail
#     tile masked by length; phase 2 is exactly the all-new path over the new tokens.
# Paged tiles start at multiples of BLOCK_N, so a tile covers whole KV blocks (BLOCK_N >=
# block_size: BLOCK_N // block_size block ids per tile) or lies inside one block (one id).
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner-loop tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads


def prefill_config(head_dim, max_seqlen_q, device, dtype=torch.bfloat16, paged=False):
    """Tile sizes by head_dim and query length: fixed heuristics from the H200 sweep in
    benchmarks/tune_kernels.py (kernels/TUNING.md has the figures), for 2-byte elements.
    paged: some keys come through the block table (a prefix hit or a chunk of a longer prompt)."""
    if device.type != "cuda" or is_interpreter():
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)  # interpreter: few big tiles
    if dtype.itemsize > 2:  # float32: the 16-bit tiles would not fit in shared memory (128x128, 3 stages: 448 KiB)
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if max_seqlen_q <= 16:
        return PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64 and max_seqlen_q > 64:  # d64: 128x64, 8 warps (8x1024: 256 vs 241 TFLOP/s for 4 warps)
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if max_seqlen_q >= 2048:  # long: big tiles amortize the softmax (1x16384: 476 vs 429 TFLOP/s)
        return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    if paged and max_seqlen_q >= 256:  # prefix through the block table: each key tile serves 128 rows (run 5,
        return PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)  # measured at 256-1024 rows)
    # shorter: small tiles, more programs in flight (16x512: 213 TFLOP/s vs 170 for 128x128 w8)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3)


@triton.jit
def _paged_rows(block_table_row_ptr, start, key_limit, stride_b, stride_t,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Row offsets (int64) of keys start..start+BLOCK_N-1 in a paged cache; `start` is a multiple
    of BLOCK_N. A tile that covers several KV blocks loads a block id per key (the same few ids, from
    L1): on the H200 that ran 2x faster at block size 16 than loading one id per block and reshaping
    the [blocks, block_size] rows into a [BLOCK_N] vector (kernels/TUNING.md, run 5)."""
    if BLOCK_N <= BLOCK_SIZE:  # the tile lies inside one block: one id, contiguous rows
        block_id = tl.load(block_table_row_ptr + start // BLOCK_SIZE).to(tl.int64)
        rows = block_id * stride_b + ((start % BLOCK_SIZE) + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_t
    else:  # the tile covers BLOCK_N // BLOCK_SIZE whole blocks: key i lies in block (start + i) // BLOCK_SIZE
        offs = start + tl.arange(0, BLOCK_N)
        if MASKED:  # keys past key_limit may lie in blocks not in the table: block 0 for them (never loaded)
            block_ids = tl.load(block_table_row_ptr + offs // BLOCK_SIZE, mask=offs < key_limit, other=0)
        else:
            block_ids = tl.load(block_table_row_ptr + offs // BLOCK_SIZE)
        rows = block_ids.to(tl.int64) * stride_b + (offs % BLOCK_SIZE).to(tl.int64) * stride_t
    return rows


@triton.jit
def online_softmax_update(qk, m_i, l_i, MASKED: tl.constexpr):
    """One key tile of the online softmax (log2 units: qk is already scaled by log2(e)).

    qk: [BLOCK_M, BLOCK_N] scores of the tile, -inf where a key is masked; m_i, l_i: [BLOCK_M], the
    running row maximum and the running sum of exp2(score - m_i) over the keys seen so far.
    Returns (p, alpha, l_i, m_i): the tile's unnormalized probabilities exp2(qk - m_new), the factor
    exp2(m_old - m_new) that rescales what was accumulated under the old maximum, and the updated
    sum and maximum. The caller then does acc = acc * alpha + p @ v, and divides by l_i at the end.
    MASKED: the tile may hold rows with no visible key yet (m stays -inf; -inf - -inf would be NaN).
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = m_new
    if MASKED:  # a row with no visible key yet keeps m = -inf; subtract 0 to avoid inf - inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def causal_tile_bounds(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Which keys the query rows m0 .. m0+BLOCK_M-1 of one sequence need (see the diagram above).

    Returns (end_n, full_end): keys [0, end_n) are visible to at least one row of the tile, keys
    [0, full_end) to every row of it (those tiles need no mask). Causal alignment is bottom-right:
    row i sees keys j <= i + (seqlen_k - seqlen_q). Both are clamped to [0, seqlen_k].
    """
    diag = seqlen_k - seqlen_q
    if CAUSAL:
        end_n = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + diag), 0)
        full_end = tl.maximum(tl.minimum(seqlen_k, m0 + 1 + diag), 0)
    else:
        end_n = seqlen_k
        full_end = seqlen_k
    return end_n, full_end


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, row_base, key_limit, diag, offs_m, offs_d, d_ok, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Online softmax over keys [start_n, end_n) (positions within the sequence; keys at or past
    key_limit are not this range's). Contiguous keys live at rows row_base + position; paged ones
    through the block table. MASKED tiles apply the causal and length masks; unmasked ones (every
    key visible to every row) skip that work and load without predicates."""
    TILE_MASK: tl.constexpr = MASKED or D_MASK
    for start in range(start_n, end_n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < key_limit
        if PAGED:
            k_rows = _paged_rows(block_table_row_ptr, start, key_limit, stride_kb, stride_kt,
                                 BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, MASKED=MASKED)
            v_rows = _paged_rows(block_table_row_ptr, start, key_limit, stride_vb, stride_vt,
                                 BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, MASKED=MASKED)
        else:
            k_rows = (row_base + offs_n).to(tl.int64) * stride_kt
            v_rows = (row_base + offs_n).to(tl.int64) * stride_vt
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
        p, alpha, l_i, m_i = online_softmax_update(qk, m_i, l_i, MASKED=MASKED)
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :], mask=tile_mask, other=tile_other)
        if KV_FP8:
            v = (v.to(tl.float32) * v_descale).to(q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # acc = acc * alpha + p @ v
    return acc, l_i, m_i


@triton.jit
def flash_attn_varlen_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, o_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    block_table_ptr, k_descale_ptr, v_descale_ptr, qk_scale, num_heads, group_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ot, stride_oh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid: (batch * num_heads, cdiv(max_seqlen_q, BLOCK_M)). Query tiles are visited last row
    block first so that the longest (causal) programs start in the first wave.
    PAGED: each sequence's prefix is in the paged cache and k/v hold the new tokens' keys, packed
    like q (see the diagram)."""
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
    end_n, full_end = causal_tile_bounds(m0, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, CAUSAL=CAUSAL)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    paged_len = 0
    if PAGED:  # phase 1: the cached prefix, keys [0, paged_len), through the block table
        paged_len = diag
        kc_head_ptr = k_cache_ptr + kv_head * stride_kch
        vc_head_ptr = v_cache_ptr + kv_head * stride_vch
        k_descale = 1.0
        v_descale = 1.0
        if KV_FP8:
            k_descale = tl.load(k_descale_ptr)
            v_descale = tl.load(v_descale_ptr)
        paged_full_end = (tl.minimum(full_end, paged_len) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_kv_range(
            acc, l_i, m_i, q, kc_head_ptr, vc_head_ptr, block_table_row_ptr,
            0, paged_full_end, 0, paged_len, diag, offs_m, offs_d, d_ok, qk_scale,
            stride_kcb, stride_kct, stride_vcb, stride_vct, k_descale, v_descale,
            BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=True, MASKED=False, CAUSAL=CAUSAL, D_MASK=D_MASK,
            KV_FP8=KV_FP8)
        acc, l_i, m_i = _attend_kv_range(
            acc, l_i, m_i, q, kc_head_ptr, vc_head_ptr, block_table_row_ptr,
            paged_full_end, tl.minimum(end_n, paged_len), 0, paged_len, diag, offs_m, offs_d, d_ok, qk_scale,
            stride_kcb, stride_kct, stride_vcb, stride_vct, k_descale, v_descale,
            BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=True, MASKED=True, CAUSAL=CAUSAL, D_MASK=D_MASK,
            KV_FP8=KV_FP8)
    # phase 2: keys [paged_len, seqlen_k) from contiguous k/v
    row_base = k_start  # key position j is row k_start + j (all keys packed by cu_seqlens_k)
    if PAGED:
        row_base = q_start - paged_len  # the new keys are packed like q
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    new_full_end = paged_len + (tl.maximum(full_end - paged_len, 0) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr,
        paged_len, new_full_end, row_base, seqlen_k, diag, offs_m, offs_d, d_ok, qk_scale,
        0, stride_kt, 0, stride_vt, 1.0, 1.0,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=False, MASKED=False, CAUSAL=CAUSAL, D_MASK=D_MASK,
        KV_FP8=False)
    acc, l_i, m_i = _attend_kv_range(
        acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr,
        new_full_end, end_n, row_base, seqlen_k, diag, offs_m, offs_d, d_ok, qk_scale,
        0, stride_kt, 0, stride_vt, 1.0, 1.0,
        BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, PAGED=False, MASKED=True, CAUSAL=CAUSAL, D_MASK=D_MASK,
        KV_FP8=False)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that see no key at all give zeros, not NaN
    out = acc / l_i[:, None]
    o_rows = (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    o_ptrs = o_ptr + o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    k_cache=None, v_cache=None, k_descale=None, v_descale=None,
):
    """Triton version of `flash_attn_varlen_ref` (same arguments and layouts).

    max_seqlen_q must be >= every query length (it sizes the grid); max_seqlen_k is unused.
    """
    reject_unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
                       softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                       return_attn_probs=(return_attn_probs, False))
    config = prefill_config(q.shape[-1], max_seqlen_q, q.device, q.dtype, paged=block_table is not None)
    return flash_attn_varlen_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    softmax_scale, causal, block_table, config, k_cache, v_cache,
                                    k_descale, v_descale)


def flash_attn_varlen_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale,
                             causal, block_table, config, k_cache=None, v_cache=None,
                             k_descale=None, v_descale=None):
    """Check shapes, allocate the output and launch with an explicit PrefillConfig (tuning)."""
    total_q, num_heads, head_dim = q.shape
    _check_cache_layout(block_table, k_cache, v_cache)
    paged = block_table is not None
    assert k.shape == v.shape and k.dim() == 3, f"k/v: [num_keys, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}"
    kv_fp8 = paged and is_fp8(k_cache.dtype)
    if paged:
        assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
            f"caches must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}")
        assert k.shape[0] == total_q, f"with k_cache, k/v hold the new tokens' keys, packed like q ({total_q})"
        assert k_cache.shape[-2:] == k.shape[-2:] and k_cache.dtype == v_cache.dtype in (k.dtype, torch.float8_e4m3fn), (
            f"caches ({k_cache.dtype}, {tuple(k_cache.shape)}) must hold k's heads in k's dtype or FP8")
        check_kv_scale("k_descale", k_descale, k_cache)
        check_kv_scale("v_descale", v_descale, v_cache)
    else:
        assert k_descale is None and v_descale is None, "k_descale/v_descale are for an FP8 paged cache"
    num_kv_heads = k.shape[-2]
    assert k.shape[-1] == head_dim, f"head_dim of q ({head_dim}) and k ({k.shape[-1]}) differ"
    assert head_dim <= 256, f"head_dim {head_dim} > 256 is not supported"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} KV heads"
    assert k.dtype == v.dtype == q.dtype, f"k/v ({k.dtype}, {v.dtype}) must be q's dtype ({q.dtype})"
    assert q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device
    assert cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.dim() == 1
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32"
    check_last_dim_contiguous(q=q, k=k, v=v)
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
        assert block_table.dtype == torch.int32 and block_table.shape[0] == batch, (
            f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} "
            f"{tuple(block_table.shape)}")
        assert block_table.stride(1) == 1, "block_table rows must be contiguous"
        block_size = k_cache.shape[1]
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    else:
        block_table = k_cache = v_cache = cu_seqlens_k  # unused placeholder pointers (PAGED=False)
        block_size = 1
        cache_strides = (0,) * 6

    out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out
    qk_scale = default_scale(head_dim, softmax_scale) * LOG2_E  # softmax with exp2
    grid = (batch * num_heads, triton.cdiv(max_seqlen_q, config.block_m))
    flash_attn_varlen_kernel[grid](
        q, k, v, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, block_table,
        k_descale if kv_fp8 else q, v_descale if kv_fp8 else q,  # placeholders when KV_FP8 is off
        qk_scale, num_heads, num_heads // num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_strides,
        out.stride(0), out.stride(1), block_table.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_SIZE=block_size, PAGED=paged,
        CAUSAL=causal, KV_FP8=kv_fp8, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
