"""Chapter 06 exercises: split-K in the decode kernel (kernels/paged_decode.py). Write each function's
body; `make exercise CH=06` runs the decode kernel's tests with them (the forced splits of
test_ragged_contexts use both).

Both are @triton.jit device functions: use `tl.*` operations, not Python loops or torch. On a CPU the
kernel runs in Triton's interpreter, so a `print(...)` inside shows values. Keep the signatures.
"""
import triton
import triton.language as tl


@triton.jit
def split_range(split, num_splits, seqlen_k, min_split_tokens, BLOCK_N: tl.constexpr):
    """Exercise 06.1: the context tokens [split_start, split_end) that program `split` reads
    (chapter 06, "Load balance: per-sequence splits and longest first").

    The grid has `num_splits` programs per (KV head, sequence); this sequence has `seqlen_k` context
    tokens. It uses only as many splits as give each at least `min_split_tokens` tokens (at least
    one split, at most num_splits), cuts its context into that many equal parts rounded up to whole
    BLOCK_N tiles, and the last part stops at seqlen_k. Programs past the context get an empty range
    (split_start >= split_end): they write zeros and a log-sum-exp of -inf, which the merge ignores.
    tl.cdiv(a, b) is ceil(a / b); tl.minimum / tl.maximum work on scalars.

    Returns (split_start, split_end).
    """
    raise NotImplementedError("exercise 06.1 (split_range) is not written yet: fill it in, "
                              "chapters/exercises/ex06_paged_attention.py; read chapters/06_paged_attention.md, "
                              "'Load balance: per-sequence splits and longest first'")


@triton.jit
def merge_split_outputs(parts, lse):
    """Exercise 06.2: merge one query row's per-split results into the softmax over its whole
    context (chapter 06, section 5, "Split-K (flash-decoding) and the merge").

    parts: [SPLITS_PAD, HEAD_DIM_PAD] float32; row s is split s's attention output, normalized over
           split s's keys only.
    lse:   [SPLITS_PAD] float32; split s's log-sum-exp in base 2, log2(sum over its keys of
           2^score), -inf for a split that saw no key (and for the padding rows past num_splits).
    Returns [HEAD_DIM_PAD]: the output normalized over every key. Subtract the largest lse before
    exponentiating (tl.math.exp2) so nothing overflows; if every split is empty (all -inf) return
    zeros, not NaN.
    """
    raise NotImplementedError("exercise 06.2 (merge_split_outputs) is not written yet: fill it in, "
                              "chapters/exercises/ex06_paged_attention.py; read chapters/06_paged_attention.md, "
                              "section 5, 'Split-K (flash-decoding) and the merge'")
