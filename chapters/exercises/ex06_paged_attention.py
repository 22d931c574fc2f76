"""Chapter 06 exercise: the paged decode kernel's body with its split of the context, the work of one
program on its share of the context, and the kernel that merges the splits (kernels/paged_decode.py).
Exercise 06.1 is both: write their bodies; `make exercise CH=06` runs the decode kernel's tests with
them. Stuck? chapters/exercises/hints/06_paged_attention.md, one level at a time.

_attend_split is the @triton.jit device function that paged_decode_kernel calls (the kernel around it,
which loads q and stores the result, and its host wrapper are given); merge_splits_kernel is the whole
merge kernel, which the host wrapper launches after it. Inside both use `tl.*` operations on blocks, not
Python loops over elements or torch. On a CPU the kernels run in Triton's interpreter, so a `print(...)` inside shows
values (on a GPU use `tl.device_print`). Keep the names and the order of the parameters.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_split(
    q, k_head_ptr, v_head_ptr, block_table_row_ptr, split, num_splits, seqlen_k, min_split_tokens,
    last_visible, offs_d, d_ok, qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Exercise 06.1, the split: attention of one (sequence, KV head) program over its share of the context, read
    through the block table (chapter 06, sections 2, 5 and "Load balance: per-sequence splits and
    longest first").

    The share. The grid has num_splits programs per (KV head, sequence); this is program `split`, and
    the sequence holds seqlen_k context tokens. Together the programs read every token exactly once,
    each a range of consecutive tokens (a program past the context reads none). A sequence uses at
    most cdiv(seqlen_k, min_split_tokens) of the programs (at least one, at most num_splits): short
    contexts are not cut into crumbs. The work is balanced: no program reads more tokens than an
    equal share among the programs it uses, rounded up to whole BLOCK_N tiles (the tests read what
    each split read back from the split buffers).
    The tokens. Token t of the sequence is in physical block block_table_row_ptr[t // block_size], at
    row t % block_size of it: its K values start at k_head_ptr + block * stride_kb + row * stride_ks
    (V: v_head_ptr, stride_vb, stride_vs), element d at + d for d in offs_d (d_ok: d < HEAD_DIM).
    Compute the offsets in int64. Never read a block table entry or a block for a token >= seqlen_k.
    The queries. q: [BLOCK_M, HEAD_DIM_PAD], one row per (query token, query head) of the KV head
    (zeros in padding rows and columns). With CAUSAL, row r sees token t iff t <= last_visible[r];
    without, every token of the context. Scores (q . k) * qk_scale are in log2 units (use
    tl.math.exp2); fold them in with chapter 05's online softmax, written here again. Cast each loaded K and V tile
    to q's dtype (`.to(q.dtype)`) before the tl.dot products, accumulating in float32: a no-op for
    a 16-bit cache (later: chapter 13's FP8 cache relies on it; its scales are applied outside).
    Returns (acc, l_i, m_i), float32, over this program's tokens only, against each row's running
    max m_i [BLOCK_M]: l_i [BLOCK_M] the sum of 2^(score - m_i), acc [BLOCK_M, HEAD_DIM_PAD] the sum of
    2^(score - m_i) * v, not normalized. A row that saw no token (an empty split, context 0) has
    acc 0, l_i 0, m_i -inf, and no NaN anywhere. The kernel then writes acc / l_i and, with several
    splits, the log-sum-exp m_i + log2(l_i) that the merge needs.
    """
    raise NotImplementedError("exercise 06.1 (_attend_split) is not written yet: fill it in, "
                              "chapters/exercises/ex06_paged_attention.py; read chapters/06_paged_attention.md, "
                              "'Load balance: per-sequence splits and longest first'")


@triton.jit
def merge_splits_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Exercise 06.1, the merge: merge the splits' partial results into each row's attention over its whole
    context (chapter 06, section 5, "Split-K (flash-decoding) and the merge").

    Grid: (num_rows,), one program per (sequence, query token, query head) row, in that order.
    mid_out: float32; split s's output for row r, normalized over split s's tokens only, is at
             mid_out_ptr + (r * num_splits + s) * HEAD_DIM + d, d < HEAD_DIM.
    mid_lse: float32; split s's log-sum-exp for row r, in base 2 (log2 of the sum over its tokens of
             2^score), is at mid_lse_ptr + r * num_splits + s; -inf for a split that read no token.
    out:     row r's HEAD_DIM values go to out_ptr + r * HEAD_DIM + d, in out's dtype
             (out_ptr.dtype.element_ty), normalized over every token of the context.
    SPLITS_PAD >= num_splits and HEAD_DIM_PAD >= HEAD_DIM are powers of two. Compute row offsets in
    int64 (rows * num_splits * HEAD_DIM can pass 2**31). Log-sum-exps can be in the hundreds:
    2^lse would overflow float32. A row whose splits all read nothing gets zeros, not NaN.
    """
    raise NotImplementedError("exercise 06.1 (merge_splits_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex06_paged_attention.py; read chapters/06_paged_attention.md, "
                              "section 5, 'Split-K (flash-decoding) and the merge'")
