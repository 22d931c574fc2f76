"""Chapter 05 exercise: the prefill kernel's main loop, with the causal tile bounds that decide which key
tiles it visits and which it masks (kernels/flash_attn_varlen.py). Exercise 05.1 is both functions: write
their bodies; `make exercise CH=05` runs the prefill kernel's tests with them. Stuck?
chapters/exercises/hints/05_flash_attention.md, one level at a time.

Both are @triton.jit device functions that flash_attn_varlen_kernel calls (the kernel, its host
wrapper and `_paged_rows` are given and stay the engine's): inside them use `tl.*` operations on
blocks, not Python loops over elements or torch. On a CPU the kernel runs in Triton's interpreter, so
a `print(...)` inside shows values (on a GPU use `tl.device_print`). Keep the names and the order of
the parameters: the kernel passes them by position, the constexprs by keyword.
"""
import triton
import triton.language as tl

from minivllm.kernels.flash_attn_varlen import _paged_rows  # noqa: F401 (given: row offsets through the block table)


@triton.jit
def _attend_kv_range(
    acc, l_i, m_i, q, k_ptr, v_ptr, block_table_row_ptr,
    start_n, end_n, row_base, key_limit, diag, offs_m, offs_d, d_ok, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, k_descale, v_descale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, D_MASK: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Exercise 05.1, the loop: the kernel's main loop. Fold the keys [start_n, end_n) of one sequence, BLOCK_N
    at a time, into the running softmax of one tile of BLOCK_M query rows of one head (chapter 05,
    sections 2, 3 and 5). The kernel calls it up to four times per program (unmasked, then masked
    tiles of the paged prefix, then of the contiguous keys) and passes the state from call to call.

    The state, returned updated as (acc, l_i, m_i), all float32, against each row's running max:
      m_i: [BLOCK_M] the largest score each row has seen (-inf while it has seen no visible key)
      l_i: [BLOCK_M] sum over the visible keys seen of 2^(score - m_i)
      acc: [BLOCK_M, HEAD_DIM_PAD] sum over the same keys of 2^(score - m_i) * v_key (not normalized)
    The kernel divides acc by l_i after the last call. A row that has seen no visible key must stay
    finite: m_i -inf, l_i 0, acc 0, never NaN.

    q: [BLOCK_M, HEAD_DIM_PAD] the query tile, in the inputs' dtype (zeros past HEAD_DIM).
    Scores: score = (q . k) * qk_scale; qk_scale has log2(e) folded in, so use base 2
    (tl.math.exp2) where the chapter writes e^x. Products of tiles: tl.dot, on operands of the
    inputs' dtype, accumulating in float32.
    Keys: position j of the sequence (0-based); the tiles start at start_n, start_n + BLOCK_N, ...
    while < end_n. Positions >= key_limit are not this range's: never read them, never count them.
    Where key j's row of head_dim values lies (element d at row offset + d, d in offs_d; columns
    past HEAD_DIM are padding where d_ok is False):
      PAGED:     in a paged cache, through the block table: _paged_rows(block_table_row_ptr, start,
                 key_limit, stride_kb, stride_kt, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE,
                 MASKED=MASKED) returns the int64 row offsets from k_ptr of keys start ..
                 start + BLOCK_N - 1 (with stride_vb, stride_vt: from v_ptr).
      not PAGED: contiguous; key j's row offset is (row_base + j) * stride_kt from k_ptr (stride_vt
                 from v_ptr). Compute offsets in int64: they can pass 2**31.
    Visibility: row r of the tile is query position offs_m[r]; with CAUSAL it sees key j iff
    j <= offs_m[r] + diag (bottom-right alignment), without CAUSAL every key < key_limit.
    MASKED: the range may hold keys past key_limit or, with CAUSAL, past some row's diagonal: mask
    them. Not MASKED: the caller guarantees that every row sees every key of the range: apply no
    mask at all (this is the fast path). D_MASK: HEAD_DIM is padded, so loads need the column mask
    in every tile. KV_FP8 is chapter 13's FP8 cache, given here: right after loading a k tile write
        if KV_FP8:
            k = (k.to(tl.float32) * k_descale).to(q.dtype)
    and the same for each v tile with v_descale (with a 16-bit cache KV_FP8 is False).
    """
    raise NotImplementedError("exercise 05.1 (_attend_kv_range) is not written yet: fill it in, "
                              "chapters/exercises/ex05_flash_attention.py; read chapters/05_flash_attention.md, "
                              "section 2, 'The online softmax'")


@triton.jit
def causal_tile_bounds(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Exercise 05.1, the bounds: which keys the query rows m0 .. m0+BLOCK_M-1 of one sequence need
    (chapter 05, section 5, and section 6 for bottom-right alignment).

    m0: first query row of the tile (0-based within the sequence); seqlen_q, seqlen_k: the
    sequence's query and key counts (seqlen_k > seqlen_q when the prompt continues a cached prefix,
    seqlen_k < seqlen_q in the tests too). Causal alignment is bottom-right: row i sees keys
    j <= i + (seqlen_k - seqlen_q).

    Returns (end_n, full_end), with 0 <= full_end <= end_n <= seqlen_k:
      end_n:    the kernel visits the keys [0, end_n) and no others
      full_end: keys [0, full_end) are visited without any mask (the kernel rounds it down to whole
                tiles itself); the tiles from there to end_n apply the causal and length masks
    The kernel must visit every key some row of the tile sees, and must mask every tile that holds a
    key some row does not see; the tests count the tiles it visits and masks with your bounds, and
    accept no more than it needs. Not CAUSAL: every row sees every key.
    m0 and the lengths are scalars inside the kernel: use tl.minimum / tl.maximum, not min / max.
    """
    raise NotImplementedError("exercise 05.1 (causal_tile_bounds) is not written yet: fill it in, "
                              "chapters/exercises/ex05_flash_attention.py; read chapters/05_flash_attention.md, "
                              "section 5, 'Causal block skipping'")
