"""Decode attention over the paged KV cache (paged attention with flash-decoding splits).

One program reads each K/V tile of one (sequence, KV head, context split) once, for all query
heads of the KV group; when the batch is too small to fill the GPU the context is split across
programs and a second kernel merges the partial results by their log-sum-exp. An FP8 cache is
read as codes and dequantized in registers (kernels/quant_fp8.py), by the conversion instruction or
by integer ops on the code's bits (`e4m3_bits_to_fp16`, DecodeConfig.fp8_convert).
vLLM: vllm/attention/ops/triton_decode_attention.py; flash-attn: flash_attn_with_kvcache.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2_E, MAX_COUNTERS, check_last_dim_contiguous, default_scale, is_interpreter, num_sms, reject_unsupported,
    zeroed_counters,
)
from .flash_attn_varlen import _gather_paged, attention_ref, online_softmax_update
from .quant_fp8 import check_kv_scale, dequantize_fp8_ref, is_fp8


def _check_kvcache_arguments(k, v, rotary_cos, cache_batch_idx, cache_leftpad, window_size, softcap, alibi_slopes,
                             return_softmax_lse, cache_seqlens, block_table):
    """flash-attn arguments we do not implement must keep their defaults; the paged ones must be set."""
    reject_unsupported(k=(k, None), v=(v, None), rotary_cos=(rotary_cos, None),
                       cache_batch_idx=(cache_batch_idx, None), cache_leftpad=(cache_leftpad, None),
                       window_size=(tuple(window_size), (-1, -1)), softcap=(softcap, 0.0),
                       alibi_slopes=(alibi_slopes, None), return_softmax_lse=(return_softmax_lse, False))
    if block_table is None or cache_seqlens is None:
        raise ValueError("flash_attn_with_kvcache needs block_table and cache_seqlens (paged cache)")


def flash_attn_with_kvcache_ref(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, seq_order=None, k_descale=None, v_descale=None,
):
    """Naive reference for `flash_attn_with_kvcache`: gather each sequence's keys, then softmax.

    q: [batch, seqlen_q, num_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; cache_seqlens: [batch] int32 (tokens in the cache, the new ones
    included); block_table: [batch, max_blocks] int32. A row with cache_seqlens 0 gives zeros.
    seq_order (a minivllm extension, not in flash-attn): the order in which the Triton kernel visits
    the sequences, a scheduling hint only; the reference ignores it. k_descale/v_descale ([1]
    float32): an FP8 cache's per-tensor scales, keys and values are code * scale.
    Returns [batch, seqlen_q, num_heads, head_dim].
    """
    _check_kvcache_arguments(k, v, rotary_cos, cache_batch_idx, cache_leftpad, window_size, softcap, alibi_slopes,
                             return_softmax_lse, cache_seqlens, block_table)
    check_kv_scale("k_descale", k_descale, k_cache)
    check_kv_scale("v_descale", v_descale, v_cache)
    scale = default_scale(q.shape[-1], softmax_scale)
    out = torch.empty_like(q)
    for i, seqlen_k in enumerate(cache_seqlens.tolist()):
        k_i = _gather_paged(k_cache, block_table[i], seqlen_k)
        v_i = _gather_paged(v_cache, block_table[i], seqlen_k)
        if is_fp8(k_cache.dtype):
            k_i, v_i = dequantize_fp8_ref(k_i, k_descale), dequantize_fp8_ref(v_i, v_descale)
        out[i] = attention_ref(q[i], k_i, v_i, scale, causal).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
#   sequence b, KV head g:  context tokens 0 .......................................... seqlen_k
#                            | split 0          | split 1          | split 2          |
#                            | tile | tile |... | tile | tile |... | tile | tile |... |
#   Each sequence's own context is cut into equal splits (whole tiles), so a split's work follows
#   the sequence's real length, not the block table's width; a sequence shorter than
#   min_split_tokens * splits uses fewer splits and its remaining programs return at once.
#   A tile of BLOCK_N tokens is gathered through the block table (token t lives in block
#   block_table[b, t // block_size] at row t % block_size), so with small cache blocks one tile
#   spans several blocks. Its query rows are all (query token, head) pairs of KV head g:
#   row r -> query token r // group_size, head g * group_size + r % group_size.
#   An FP8 cache: a code converts to q's dtype exactly (e4m3 values are bf16/fp16 values), so the
#   tiles are dequantized by that cast alone and the per-tensor scales go where they cost one
#   multiply: k_scale into the score scale, v_scale onto the normalized output. With
#   fp8_convert="bits" the cast is a few integer ops instead (e4m3_bits_to_fp16), whose fp16 tiles
#   are 2^-8 times the codes' values; the 2^8 joins the two scales, so the outputs are the same.
#   Grid (num_kv_heads, batch, num_splits): blocks start in that order (heads fastest), so when the
#   engine passes seq_order longest first, the long programs start first and short ones fill the
#   tail (longest-processing-time-first scheduling).
# ----------------------------------------------------------------------------------------------


FP8_CONVERTS = ("cvt", "bits")


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # context tokens per tile (gathered across cache blocks)
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V gathers
    programs_per_sm: int  # split the context until batch*kv_heads*splits reaches this many per SM
    min_split_tokens: int  # never split finer than this many tokens
    # An FP8 cache's codes to 16 bits: "cvt" by the conversion instruction (the cast), "bits" by
    # integer ops on the bytes (e4m3_bits_to_fp16). No effect on other caches.
    fp8_convert: str = "cvt"
    # The dots' rows (query token, query head of the KV head) padded to at least this many. 64 lets
    # Hopper issue warpgroup MMAs (wgmma), which read K and V from shared memory: an FP8 tile is then
    # converted once, 16 bytes at a time, into that 16-bit copy, instead of byte by byte into the
    # registers of a 16-row mma (triton 3.6, sm_90, 64-key tiles: 648 SASS instructions per tile
    # instead of 827).
    min_block_m: int = 16
    # With splits: the last program of each (sequence, KV head) to finish merges that pair's splits
    # itself, found by a counter per pair as the split-K GEMV finds its last split (kernels/gemv.py),
    # instead of merge_splits_kernel after it: one launch fewer per layer. Off: the two kernels.
    fused_merge: bool = False

    def __post_init__(self):
        if self.fp8_convert not in FP8_CONVERTS:
            raise ValueError(f"fp8_convert must be one of {FP8_CONVERTS}, got {self.fp8_convert!r}")
        if self.min_block_m not in (16, 32, 64, 128):
            raise ValueError(f"min_block_m must be 16, 32, 64 or 128, got {self.min_block_m}")


def decode_config(head_dim, device):
    """Fixed heuristics (tuned on an H200); nothing here reads tensor contents."""
    if device.type != "cuda" or is_interpreter():
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1, programs_per_sm=2,
                            min_split_tokens=16)
    # H200 sweep (kernels/TUNING.md): 64-token tiles, 4 warps, 2 stages read 94-101% of the copy
    # bandwidth at 256x1024..256x4096; ~8 programs per SM keeps the last wave short when splitting.
    # Splits as short as one tile: at batch 1 x 1024 that is 16 splits (128 programs, not 32), 1.38x
    # faster on an H100 (run 8). A grid of many sequences has few splits anyway (one at 256 sequences).
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=8,
                        min_split_tokens=64)


def decode_num_splits(batch, num_kv_heads, max_context, device, config):
    """Context splits per sequence from shapes only (CUDA-graph safe: no look at cache_seqlens)."""
    num_programs = batch * num_kv_heads
    sm_count = num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    wanted = triton.cdiv(config.programs_per_sm * sm_count, max(num_programs, 1))
    return max(1, min(wanted, triton.cdiv(max_context, config.min_split_tokens)))


@triton.jit
def split_range(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    """The context tokens [split_start, split_end) that program `split` of `num_splits` reads.

    A sequence uses at most cdiv(seqlen_k, min_split_tokens) splits (at least one), each a whole
    number of BLOCK_N tiles, the last one cut at seqlen_k; splits past the context get an empty
    range (split_start >= split_end) and write zeros with a log-sum-exp of -inf.
    """
    num_splits_used = tl.maximum(tl.minimum(num_splits, tl.cdiv(seqlen_k, min_split_tokens)), 1)
    tokens_per_split = tl.cdiv(tl.cdiv(seqlen_k, num_splits_used), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seqlen_k)
    return split_start, split_end


@triton.jit
def merge_split_outputs(parts, lse):
    """Merge the normalized partial outputs of one row's context splits into the full softmax's.

    parts: [SPLITS_PAD, HEAD_DIM_PAD] float32, split s's output normalized over its own keys;
    lse: [SPLITS_PAD], split s's log2-sum-exp log2(sum_j 2^score_j), -inf for an empty split (and
    for the padding splits). Split s's share of the whole softmax is 2^lse_s / sum_t 2^lse_t:
    out = sum_s 2^(lse_s - max) * parts_s / sum_s 2^(lse_s - max). Every split empty -> zeros.
    """
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty
    weights = tl.math.exp2(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits
    total = tl.sum(weights, 0)
    return tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)


E4M3_BITS_FACTOR = tl.constexpr(256.0)  # 2^(15 - 7): fp16's exponent bias over e4m3's


@triton.jit
def e4m3_bits_to_fp16(codes):
    """e4m3 (float8_e4m3fn) codes, read as uint8, to float16 by integer ops alone: exactly 2^-8
    times each code's value, for every code but the two NaNs. The caller multiplies by
    E4M3_BITS_FACTOR = 2^8 once, where a scale is applied anyway (scores, output).

        e4m3 byte b:                            s eeee mmm   (-1)^s * 2^(e - 7) * 1.mmm    (e = 0: 2^-6 * 0.mmm)
        as int8, sign-extended:         s ... s s eeee mmm   (bits 31..8: copies of s)
        << 7:                   s ... s s eeee mmm 0000000
        & 0xBF80:                     s 0 eeee mmm 0000000   fp16 bits: sign | 5 exponent | 10 mantissa
                                                             (-1)^s * 2^(e - 15) * 1.mmm   (e = 0: 2^-14 * 0.mmm)

    The same word as ((b & 0x80) << 8) | ((b & 0x7F) << 7), in two ops (and a sign-extending byte
    load): a copy of the sign lands on bit 15, the mask drops the one on bit 14. The exponent fills
    the low 4 of fp16's 5 bits with the same field e, read with bias 15 instead of 7, so a normal
    code reads 2^-8 times its value; a subnormal code (e = 0) lands on an fp16 subnormal, 2^-14 =
    2^-8 * 2^-6 times 0.mmm, exact too. The NaN codes 0x7F / 0xFF (e4m3fn has no inf) come out as
    +-1.875, +-480 after the factor, not NaN; the store kernels never write them (they saturate
    at +-448), only a NaN input would. This is how GPUs without an FP8 conversion instruction
    (before Ada) read e4m3; on Hopper, Triton's code for it (each byte shifted and masked on its
    own, then repacked in pairs) is longer than the one instruction per pair of "cvt".
    """
    signed = codes.to(tl.int8, bitcast=True).to(tl.int32)
    return ((signed << 7) & 0xBF80).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _dot_operand(tile, dtype):
    """A K or V tile as a dot operand in `dtype`: the cache's own values or FP8 codes by a cast;
    e4m3 bytes (an FP8 cache read as uint8: fp8_convert="bits") by e4m3_bits_to_fp16, 2^-8 times
    their values (the kernel puts the 2^8 into the scales)."""
    if tile.dtype == tl.uint8:
        return e4m3_bits_to_fp16(tile).to(dtype)
    else:
        return tile.to(dtype)


@triton.jit
def _attend_split(
    q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, num_splits, seqlen_k, min_split_tokens,
    last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Online softmax over the context tokens of split `split`, read BLOCK_N at a time through the
    block table (see the diagram). Returns (acc, l_i, m_i) against the running max m_i: acc [BLOCK_M,
    HEAD_DIM_PAD] and l_i [BLOCK_M] the unnormalized sums of 2^(score - m_i) * v and 2^(score - m_i)."""
    split_start, split_end = split_range(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N=BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < split_end
        block_ids = tl.load(block_table_row_ptr + offs_n // block_size, mask=n_ok).to(tl.int64)
        in_block = offs_n % block_size
        tile_mask = n_ok[:, None] & d_ok[None, :]
        k_rows = block_ids * stride_kb + in_block * stride_ks
        k = tl.load(k_head_ptr + k_rows[:, None] + offs_d[None, :], mask=tile_mask, other=0.0)
        qk = tl.dot(q, tl.trans(_dot_operand(k, q.dtype))) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= last_visible[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        p, alpha, l_i, m_i = online_softmax_update(qk, m_i, l_i, MASKED=True)  # the prefill kernel's step
        v_rows = block_ids * stride_vb + in_block * stride_vs
        v = tl.load(v_head_ptr + v_rows[:, None] + offs_d[None, :], mask=tile_mask, other=0.0)
        acc = tl.dot(p.to(q.dtype), _dot_operand(v, q.dtype), acc * alpha[:, None])  # acc = acc * alpha + p @ v
    return acc, l_i, m_i


@triton.jit
def _merge_when_last(
    mid_ptr, lse_ptr, final_ptr, counter_ptr, seq, kv_head, num_splits, seqlen_q, group_size,
    stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh, stride_fb, stride_ft, stride_fh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Count this split done for (seq, kv_head); the program that counts last merges the pair's rows
    (query token x query head of the KV head) from every split's partial, writes them to final and
    resets the counter (for the next call, or the next replay of a graph that captured this one)."""
    counter = counter_ptr + seq * tl.num_programs(0) + kv_head
    done = tl.atomic_add(counter, 1)  # acq_rel: this split's partial is visible before its count
    if done == num_splits - 1:
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        s_ok = offs_s < num_splits
        d_ok = offs_d < HEAD_DIM
        for r in range(0, seqlen_q * group_size):
            q_tok = r // group_size
            head = kv_head * group_size + r % group_size
            lse_row = lse_ptr + seq.to(tl.int64) * stride_lb + q_tok * stride_lt + head * stride_lh
            mid_row = mid_ptr + seq.to(tl.int64) * stride_ob + q_tok * stride_ot + head * stride_oh
            lse = tl.load(lse_row + offs_s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")  # from L2:
            parts = tl.load(mid_row + offs_s[:, None] * stride_os + offs_d[None, :],  # other SMs wrote them
                            mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
            out = merge_split_outputs(parts, lse)
            final_row = final_ptr + seq.to(tl.int64) * stride_fb + q_tok * stride_ft + head * stride_fh
            tl.store(final_row + offs_d, out.to(final_ptr.dtype.element_ty), mask=d_ok)
        tl.store(counter, 0)


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, cache_seqlens_ptr, block_table_ptr, seq_order_ptr,
    k_descale_ptr, v_descale_ptr, qk_scale, seqlen_q, group_size, block_size, min_split_tokens,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh, stride_bt,
    final_ptr, counter_ptr, stride_fb, stride_ft, stride_fh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_FP16: tl.constexpr, FP8_BITS: tl.constexpr,
    FUSED_MERGE: tl.constexpr = False, SPLITS_PAD: tl.constexpr = 2,
):
    """Grid: (num_kv_heads, batch, num_splits). Without SPLIT, writes the normalized output;
    with SPLIT, writes this split's normalized partial output (fp32) and its log2-sum-exp, and with
    FUSED_MERGE the last split of each (sequence, KV head) merges them into final (_merge_when_last)."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if HAS_ORDER:
        seq = tl.load(seq_order_ptr + seq)
    split = tl.program_id(2)
    seqlen_k = tl.load(cache_seqlens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_tok = rows // group_size
    head = kv_head * group_size + rows % group_size
    row_ok = rows < seqlen_q * group_size
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = seq.to(tl.int64) * stride_qb + q_tok * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    last_visible = seqlen_k - seqlen_q + q_tok  # bottom-right causal: key j visible iff j <= this
    if KV_FP8:
        # FP8_BITS: the caches come as uint8, their tiles from e4m3_bits_to_fp16 at 2^-8 of their
        # values; the 2^8 goes into the two scales here and below, once per program, exactly.
        fp8_factor = E4M3_BITS_FACTOR if FP8_BITS else 1.0
        qk_scale = qk_scale * (tl.load(k_descale_ptr) * fp8_factor)
        if DOT_FP16:  # 16-bit q: e4m3 codes convert to float16 in one instruction on Ada/Hopper,
            q = q.to(tl.float16)  # to bfloat16 only through float32 (which made this loop compute-bound)

    block_table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    acc, l_i, m_i = _attend_split(
        q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, tl.num_programs(2), seqlen_k, min_split_tokens,
        last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
        BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # empty context or split -> zeros
    if KV_FP8:
        out = out * (tl.load(v_descale_ptr) * fp8_factor)
    o_rows = seq.to(tl.int64) * stride_ob + q_tok * stride_ot + head * stride_oh + split * stride_os
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        lse_rows = seq.to(tl.int64) * stride_lb + q_tok * stride_lt + head * stride_lh + split
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)
        if FUSED_MERGE:
            _merge_when_last(out_ptr, lse_ptr, final_ptr, counter_ptr, seq, kv_head, tl.num_programs(2), seqlen_q,
                             group_size, stride_ob, stride_ot, stride_oh, stride_os, stride_lb, stride_lt, stride_lh,
                             stride_fb, stride_ft, stride_fh, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD)


@triton.jit
def merge_splits_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program per (sequence, query token, head) row: out = sum_s w_s * o_s / sum_s w_s with
    w_s = 2^(lse_s - max lse). mid_out: [rows, num_splits, HEAD_DIM]; mid_lse: [rows, num_splits]."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    parts = tl.load(mid_out_ptr + row * num_splits * HEAD_DIM + offs_s[:, None] * HEAD_DIM
                    + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = merge_split_outputs(parts, lse)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=True,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, seq_order=None, k_descale=None, v_descale=None,
):
    """Triton version of `flash_attn_with_kvcache_ref` (same arguments).

    num_splits=0 picks the number of context splits from shapes (batch, KV heads, block_table
    width), so the call never syncs with the host and can be captured in a CUDA graph; each
    sequence then divides its own context into at most that many splits of >= min_split_tokens.
    seq_order (minivllm extension): optional int32 [batch] permutation, program row i works on
    sequence seq_order[i]; passing the sequences longest first shortens the kernel's tail when
    context lengths vary. It changes no result.
    """
    _check_kvcache_arguments(k, v, rotary_cos, cache_batch_idx, cache_leftpad, window_size, softcap, alibi_slopes,
                             return_softmax_lse, cache_seqlens, block_table)
    config = decode_config(q.shape[-1], q.device)
    if num_splits == 0:
        max_context = block_table.shape[1] * k_cache.shape[1]
        num_splits = decode_num_splits(q.shape[0], k_cache.shape[2], max_context, q.device, config)
    return paged_decode_launch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale,
                               causal, num_splits, config, seq_order, k_descale, v_descale)


def paged_decode_launch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                        num_splits, config, seq_order=None, k_descale=None, v_descale=None):
    """Check shapes, allocate outputs and launch with an explicit config and split count."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], got "
        f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim, f"head_dim of q ({head_dim}) and cache differ"
    assert head_dim <= 256, f"head_dim {head_dim} > 256 is not supported"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} KV heads"
    group_size = num_heads // num_kv_heads
    if seqlen_q * group_size > 128:
        raise NotImplementedError(f"seqlen_q * group_size = {seqlen_q * group_size} > 128")
    kv_fp8 = is_fp8(k_cache.dtype)
    assert k_cache.dtype == v_cache.dtype and (kv_fp8 or k_cache.dtype == q.dtype), (
        f"caches ({k_cache.dtype}, {v_cache.dtype}) must both be q's dtype ({q.dtype}) or FP8")
    check_kv_scale("k_descale", k_descale, k_cache)
    check_kv_scale("v_descale", v_descale, v_cache)
    assert cache_seqlens.shape == (batch,) and cache_seqlens.dtype == torch.int32, (
        f"cache_seqlens must be int32 [batch={batch}], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    assert block_table.dim() == 2 and block_table.shape[0] == batch and block_table.dtype == torch.int32, (
        f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert q.device == k_cache.device == v_cache.device == cache_seqlens.device == block_table.device
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    if seq_order is not None:
        assert seq_order.shape == (batch,) and seq_order.dtype == torch.int32 and seq_order.device == q.device, (
            f"seq_order must be int32 [batch={batch}] on {q.device}, got {seq_order.dtype} {tuple(seq_order.shape)}")

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [batch, seqlen_q, heads, d]
    if batch == 0:
        return out
    fp8_bits = kv_fp8 and config.fp8_convert == "bits"
    if fp8_bits:  # the codes as plain bytes: the kernel builds their fp16 bits (e4m3_bits_to_fp16)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # no split could ever get min_split_tokens of context beyond this many
    num_splits = max(1, min(num_splits, triton.cdiv(block_table.shape[1] * block_size, config.min_split_tokens)))
    split = num_splits > 1
    if split:
        mid_out = torch.empty((batch, seqlen_q, num_heads, num_splits, head_dim),
                              dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, seqlen_q, num_heads, num_splits),
                              dtype=torch.float32, device=q.device)
        dst, lse, stride_os = mid_out, mid_lse, mid_out.stride(3)
    else:
        dst, lse, stride_os = out, out, 0
    fused_merge = split and config.fused_merge
    if fused_merge and batch * num_kv_heads > MAX_COUNTERS:
        raise ValueError(f"{batch} sequences x {num_kv_heads} KV heads with a fused merge; at most {MAX_COUNTERS}")
    counters = zeroed_counters(q.device, "paged decode's merge") if fused_merge else cache_seqlens  # placeholder
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    paged_decode_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, dst, lse, cache_seqlens, block_table,
        cache_seqlens if seq_order is None else seq_order,  # placeholder pointer when HAS_ORDER is off
        k_descale if kv_fp8 else q, v_descale if kv_fp8 else q,  # placeholders when KV_FP8 is off
        default_scale(head_dim, softmax_scale) * LOG2_E, seqlen_q, group_size, block_size,
        config.min_split_tokens,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2), stride_os,
        lse.stride(0), lse.stride(1), lse.stride(2), block_table.stride(0),
        out, counters, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=max(config.min_block_m, triton.next_power_of_2(seqlen_q * group_size)), BLOCK_N=config.block_n,
        CAUSAL=causal and seqlen_q > 1, SPLIT=split, HAS_ORDER=seq_order is not None,
        KV_FP8=kv_fp8, DOT_FP16=kv_fp8 and q.element_size() == 2, FP8_BITS=fp8_bits,
        FUSED_MERGE=fused_merge, SPLITS_PAD=splits_pad,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split and not fused_merge:
        merge_splits_kernel[(batch * seqlen_q * num_heads,)](
            mid_out, mid_lse, out, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), SPLITS_PAD=splits_pad,
        )
    return out
