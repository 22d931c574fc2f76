"""Chapter 04b exercises: the bodies of the primer's four kernels (kernels/primer.py), as Triton-Puzzles.
Write each kernel's body; `make exercise CH=04b` runs tests/test_triton_primer.py with them.

Each is a whole @triton.jit kernel: the host wrapper in kernels/primer.py (which you keep) computes
the grid and passes the arguments by keyword, so keep the names and the order of the parameters.
Inside, use `tl.*` operations on blocks, not Python loops over elements or torch. On a CPU the kernels
run in Triton's interpreter, so a `print(...)` inside shows values (on a GPU use `tl.device_print`).
Stuck? chapters/exercises/hints/04b_triton_primer.md has three hints a puzzle, one level at a time.
"""
import triton
import triton.language as tl


@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """Exercise 04b.1: out = x + y over n_elements values (chapter 04b, section 2).

    The grid is (cdiv(n_elements, BLOCK_SIZE),): this program owns the BLOCK_SIZE consecutive
    elements that start at its program id times BLOCK_SIZE. n_elements need not be a multiple of
    BLOCK_SIZE: the last program must neither read nor write past the end.
    """
    raise NotImplementedError("exercise 04b.1 (vector_add_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex04b_triton_primer.py; read chapters/04b_triton_primer.md, "
                              "section 2, 'Blocks and masks'")


@triton.jit
def softmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK_N: tl.constexpr):
    """Exercise 04b.2: the softmax of one row of x, written to the same row of out (chapter 04b, section 4).

    The grid is (num_rows,): one program per row. Row r starts r * stride_x_row elements after x_ptr
    (and r * stride_out_row after out_ptr); its n_cols values are contiguous. BLOCK_N is the power of
    two >= n_cols, so the whole row is one block. Compute in float32 and store in out's dtype
    (out_ptr.dtype.element_ty). The tests feed rows whose values are near 1000: e^1000 is inf in
    float32, so compute a form of the softmax that never exponentiates a large number.
    """
    raise NotImplementedError("exercise 04b.2 (softmax_rows_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex04b_triton_primer.py; read chapters/04b_triton_primer.md, "
                              "section 4, 'One program per row: a fused softmax'")


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Exercise 04b.3: C = A @ B, one [BLOCK_M, BLOCK_N] tile of C per program (chapter 04b, section 5).

    A is [M, K], B [K, N], C [M, N]; element (i, j) of A is at a_ptr + i * stride_am + j * stride_ak
    (the same for B and C with their strides: B may be a transposed view). The grid is
    (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): program (pid 0, pid 1) owns the tile at that row and column
    block. M, N and K need not be multiples of the blocks. Accumulate in float32 and store in C's
    dtype (c_ptr.dtype.element_ty). The tile sizes are each >= 16, as tl.dot requires.
    """
    raise NotImplementedError("exercise 04b.3 (matmul_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex04b_triton_primer.py; read chapters/04b_triton_primer.md, "
                              "section 5, 'tl.dot and tiles'")


@triton.jit
def causal_tile_kernel(
    q_ptr, k_ptr, s_ptr, M, N, D, stride_qm, stride_kn, stride_sm, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Exercise 04b.4: one [BLOCK_M, BLOCK_N] tile of causal attention scores (chapter 04b, section 6).

    q is [M, D] (row i at q_ptr + i * stride_qm), k is [N, D] (row j at k_ptr + j * stride_kn), both
    contiguous along D; s is float32 [M, N] (row stride stride_sm). The grid is
    (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). Write s[i, j] = scale * (q_i . k_j), and -inf where key j
    is in query i's future. The alignment is bottom-right: the M queries are the last M of the N
    positions (N >= M when they continue a cached prefix; N < M is allowed too, and then some rows
    see no key at all). BLOCK_D is a power of two >= max(D, 16): one block holds a whole row of q or k.
    """
    raise NotImplementedError("exercise 04b.4 (causal_tile_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex04b_triton_primer.py; read chapters/04b_triton_primer.md, "
                              "section 6, 'A causal score tile'")
