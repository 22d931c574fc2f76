"""Chapter 17 exercise: the small-batch GEMV (kernels/gemv.py), y = prologue(x) W^T (+ b) for the few rows
of a decode step at batch 1, each weight read once, the RMSNorm or SiLU-and-mul before the GEMV folded
into its prologue, and K split over programs whose partials the last one to finish sums. Exercise 17.1
is the whole kernel: write its body; `make exercise CH=17` runs the GEMV's tests with it. Stuck?
chapters/exercises/hints/17_small_batch_decode.md, one level at a time.

It replaces gemv_kernel of kernels/gemv.py, which the host wrapper `gemv` launches. The wrapper (the
argument checks, the tiles gemv_config picks, the outputs, the split-K workspace and counters) stays the
engine's, and so does `_row_rstd`, each row's 1 / rms for the norm, imported below. Inside use `tl.*`
operations on blocks, not Python loops over elements or torch. On a CPU the kernel runs in Triton's
interpreter, so a `print(...)` inside shows values. Keep the names and the order of the parameters.
"""
import triton
import triton.language as tl

# The prologue codes (tl.constexpr: compare PROLOGUE with them) and the norm's 1 / rms of each row:
#   _row_rstd(x_ptr, res_ptr, rows, row_mask, K, stride_x, stride_res, eps, ADD, BLOCK_M, BLOCK_K) -> [BLOCK_M]
# rows: the row indices (int64), row_mask: rows < M; ADD: sum x + residual first (rounded to x's dtype).
from minivllm.kernels.gemv import ADD_RMS_NORM, NONE, RMS_NORM, SILU_AND_MUL, _row_rstd  # noqa: F401


@triton.jit(do_not_specialize=["M", "eps"])  # one compiled variant for every batch size and eps
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_w_ptr, partial_ptr, counter_ptr,
    M, N, K, k_per_split, stride_x, stride_res, stride_sum, stride_w, stride_out, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Exercise 17.1: out = prologue(x) W^T (+ bias) for M <= BLOCK_M rows, the prologue computed as the
    weights stream by (chapter 17, section 3, "A GEMV for a few rows").

    The grid: (cdiv(N, BLOCK_N), SPLIT_K). Program (n, s) owns the output columns [n * BLOCK_N,
    (n + 1) * BLOCK_N) of all M rows (the last tile is cut short by N) and reads split s of K, the columns
    [s * k_per_split, min(K, (s + 1) * k_per_split)), BLOCK_K at a time (k_per_split is a multiple of
    BLOCK_K; a split may hold fewer columns than the others). Every weight is read once, by one program.
    The memory. x [M, K] ([M, 2K] for SILU_AND_MUL): row m at x_ptr + m * stride_x, columns contiguous;
    weight [N, K]: row j at w_ptr + j * stride_w (N * K can pass 2**31: int64 offsets); out [M, N] in
    out's own dtype (out_ptr.dtype.element_ty, float32 for logits): row m at out_ptr + m * stride_out;
    bias [N] if HAS_BIAS; norm_w [K], the norm's weight g; residual [M, K] at res_ptr + m * stride_res;
    the residual stream [M, K] at res_out_ptr + m * stride_sum. The pointers a call does not use point at
    another tensor: never read or write them.
    The prologue a, a block of x's dtype (w_ptr.dtype.element_ty) made in the K loop from the columns it
    needs, rounded where the unfused layers round (gemv_ref):
      NONE          a = x.
      RMS_NORM      a = ((x * rstd) rounded * g) rounded, two roundings, the float products in float32;
                    rstd = 1 / sqrt(mean(x^2) + eps) over the whole row, every column of K whatever the
                    split (_row_rstd with ADD=False).
      ADD_RMS_NORM  s = (x + residual) rounded; then a is RMS_NORM's on s (_row_rstd with ADD=True). s is
                    the residual stream the next layer reads: write it to res_out, every column of every
                    row exactly once over the whole grid.
      SILU_AND_MUL  x = [gate | up], up K columns after gate in each row: a = silu(gate) * up computed in
                    float32 and rounded once.
    The GEMV: acc[m, j] = the sum over the split's columns k of a[m, k] * W[j, k], in float32. With DOT,
    tl.dot of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (the wrapper makes BLOCK_M >= 16 then); in
    float32 pass input_precision="ieee", or a GPU rounds the operands to tf32 (the interpreter does not).
    Without, multiply-adds: keep each column's products ([BLOCK_M, BLOCK_N, BLOCK_K] float32) across the
    loop and sum them over K once, after it, not across the threads at every tile.
    The result. SPLIT_K == 1: out = acc + bias, rounded once to out's dtype. SPLIT_K > 1, where the
    programs of a tile finish in any order:
      - each stores its acc to the float32 workspace partial [SPLIT_K, M, N], split s, row m, column j
        at partial_ptr + (s * M + m) * N + j;
      - then counts itself done on its tile's counter, the int32 at counter_ptr + n (0 before the call),
        with tl.atomic_add, which returns the count before its own (and, acq_rel, makes the partial
        stored before it visible to whoever sees the count after);
      - the one that counts last (it sees SPLIT_K - 1) sums the tile's SPLIT_K partials in split order,
        0, 1, ..., SPLIT_K - 1, whichever split it is (the same bits whoever finishes last), adds the
        bias, rounds once to out's dtype, stores out, and sets the counter back to 0 for the next call
        and for the next replay of a CUDA graph that captured this one. Other programs wrote those
        partials: load them from L2 (cache_modifier=".cg"), not from this SM's L1.
    Mask every load and store by the M rows, the N columns and the split's end.
    """
    raise NotImplementedError("exercise 17.1 (gemv_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex17_small_batch_decode.py; read chapters/17_small_batch_decode.md, "
                              "section 3, 'A GEMV for a few rows'")
