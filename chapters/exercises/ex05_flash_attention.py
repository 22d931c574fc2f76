"""Chapter 05 exercises: the two pieces of the prefill kernel (kernels/flash_attn_varlen.py) that carry
its ideas. Write each function's body; `make exercise CH=05` runs the prefill kernel's tests with them.

Both are @triton.jit device functions: inside them use `tl.*` operations on blocks, not Python
loops or torch. On a CPU the kernel runs in Triton's interpreter, so a `print(...)` inside shows
values (on a GPU use `tl.device_print`). Keep the signatures: the kernel calls them by keyword.
"""
import triton
import triton.language as tl


@triton.jit
def online_softmax_update(qk, m_i, l_i, MASKED: tl.constexpr):
    """Exercise 05.1: fold one tile of scores into a running softmax (chapter 05, section 2).

    qk:  [BLOCK_M, BLOCK_N] float32 scores of this key tile, already multiplied by log2(e), so use
         exp2 (tl.math.exp2) where the derivation has e^x; -inf where a key is masked.
    m_i: [BLOCK_M] running maximum of each row's scores so far (-inf before the first tile).
    l_i: [BLOCK_M] running sum of exp2(score - m_i) over the keys seen so far.
    MASKED: tiles that apply a mask; a row may then have seen no visible key at all, its maximum
         stays -inf, and exp2(-inf - -inf) would be NaN: subtract 0 instead of -inf for such rows.

    Returns (p, alpha, l_new, m_new):
      m_new: [BLOCK_M] max(m_i, the row max of qk)
      p:     [BLOCK_M, BLOCK_N] exp2(qk - m_new), the tile's probabilities, not normalized
      alpha: [BLOCK_M] exp2(m_i - m_new), which rescales what was accumulated against m_i
      l_new: [BLOCK_M] l_i * alpha + the row sums of p
    The kernel then computes acc = acc * alpha + p @ V_tile and, after the last tile, acc / l.
    """
    raise NotImplementedError("exercise 05.1 (online_softmax_update) is not written yet: fill it in, "
                              "chapters/exercises/ex05_flash_attention.py; read chapters/05_flash_attention.md, "
                              "section 2, 'The online softmax'")


@triton.jit
def causal_tile_bounds(m0, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Exercise 05.2: which keys the query rows m0 .. m0+BLOCK_M-1 of one sequence need
    (chapter 05, section 5, and section 6 for bottom-right alignment).

    m0: first query row of the tile (0-based within the sequence); seqlen_q, seqlen_k: the
    sequence's query and key counts (seqlen_k > seqlen_q when the prompt continues a cached prefix).
    Causal alignment is bottom-right: row i sees keys j <= i + (seqlen_k - seqlen_q).

    Returns (end_n, full_end), both clamped to [0, seqlen_k]:
      end_n:    keys [0, end_n) are visible to at least one row of the tile (the last row's limit)
      full_end: keys [0, full_end) are visible to every row of it (the first row's limit); the
                kernel rounds it down to whole tiles itself
    Not CAUSAL: every row sees every key.
    Use tl.minimum / tl.maximum (m0 and the lengths are scalars inside the kernel).
    """
    raise NotImplementedError("exercise 05.2 (causal_tile_bounds) is not written yet: fill it in, "
                              "chapters/exercises/ex05_flash_attention.py; read chapters/05_flash_attention.md, "
                              "section 5, 'Causal block skipping'")
