"""Triton from zero: four small kernels that teach programs, blocks, masks, strides and tl.dot tiles.

The primer chapter (chapters/04b_triton_primer.md) walks through them in order, and its exercises
(chapters/exercises/ex04b_triton_primer.py) ask for each kernel's body again. None of them runs in the
engine; the attention kernels (flash_attn_varlen.py, paged_decode.py) are built from the same pieces.
Triton: python/tutorials/01-vector-add.py, 02-fused-softmax.py, 03-matrix-multiplication.py.
"""
import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------
# 1. vector_add: one program per BLOCK_SIZE elements; the last block is masked.
#
#     x:  [ block 0 | block 1 | block 2 |tail..]      n_elements = 2.5 blocks
#           pid 0     pid 1     pid 2   ^ offsets >= n_elements: mask False, nothing loaded or stored
# ----------------------------------------------------------------------------------------------

def vector_add_ref(x, y):
    return x + y


@triton.jit
def vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def vector_add(x, y):
    """Triton version of `vector_add_ref`: x + y for contiguous tensors of one shape and dtype."""
    assert x.shape == y.shape, f"x and y must have one shape, got {tuple(x.shape)} and {tuple(y.shape)}"
    assert x.dtype == y.dtype and x.dtype in SUPPORTED_DTYPES, f"dtypes {x.dtype}, {y.dtype}"
    assert x.is_contiguous() and y.is_contiguous(), "x and y must be contiguous (read as flat arrays)"
    out = torch.empty_like(x)
    n_elements = x.numel()
    if n_elements == 0:
        return out
    block_size = 1024
    grid = (triton.cdiv(n_elements, block_size),)
    vector_add_kernel[grid](x, y, out, n_elements, BLOCK_SIZE=block_size)
    return out


# ----------------------------------------------------------------------------------------------
# 2. softmax_rows: one program per row; the whole row is one block (BLOCK_N >= n_cols), so the
#    max, the exponentials and the sum never leave registers: one read and one write of the row.
#
#     row r:  [ x0 x1 ... x(n-1) | -inf ... -inf ]     padding columns load as -inf: exp(-inf) = 0
#              <----- n_cols ----> <- BLOCK_N - n_cols ->
# ----------------------------------------------------------------------------------------------

def softmax_rows_ref(x):
    """x: [num_rows, n_cols] -> softmax over each row, computed in float32, returned in x.dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


@triton.jit
def softmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * stride may pass 2**31
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)  # the largest is 0: exp never overflows
    numerator = tl.exp(x)
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def softmax_rows(x):
    """Triton version of `softmax_rows_ref`: x [num_rows, n_cols], rows may be strided."""
    assert x.dim() == 2, f"x must be [num_rows, n_cols], got shape {tuple(x.shape)}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} not supported (use one of {SUPPORTED_DTYPES})"
    assert x.stride(1) == 1, f"x must be contiguous in its last dim (strides {x.stride()})"
    num_rows, n_cols = x.shape
    assert n_cols <= 65536, f"a row must fit one block: n_cols {n_cols} > 65536"
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    grid = (num_rows,)
    softmax_rows_kernel[grid](x, out, n_cols, x.stride(0), out.stride(0),
                              BLOCK_N=triton.next_power_of_2(n_cols))
    return out


# ----------------------------------------------------------------------------------------------
# 3. matmul: program (i, j) owns the [BLOCK_M, BLOCK_N] tile C[i, j] and walks K in BLOCK_K steps,
#    accumulating in float32. Rows and columns past M, N, K load as 0 (adding 0 changes nothing).
#
#              K ->                      N ->                       N ->
#         +--+--+--+                +----+----+                +----+----+
#  M   i  |a0|a1|a2|   x   K   a0 ~ | b0 | j  |   =   M    i   |    |C_ij|   C_ij = a0 b0 + a1 b1 + a2 b2
#  |      +--+--+--+       |   a1 ~ | b1 |    |        |       +----+----+
#  v                       v   a2 ~ | b2 |    |        v
#                                   +----+----+
# ----------------------------------------------------------------------------------------------

def matmul_ref(a, b):
    """a [M, K] @ b [K, N] in float32, returned in a.dtype."""
    return (a.float() @ b.float()).to(a.dtype)


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of A and C
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of B and C
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,  # [BLOCK_M, BLOCK_K]
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,  # [BLOCK_K, BLOCK_N]
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)  # acc += a @ b on the tensor cores, float32 accumulator
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def matmul(a, b, block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3):
    """Triton version of `matmul_ref`: a [M, K] @ b [K, N] -> a new [M, N] tensor in a.dtype.

    Any strides (a transposed view is read as it lies). The tile sizes are tl.dot's: each >= 16.
    num_warps and num_stages change how the GPU runs a program, not what it computes.
    """
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], (
        f"a must be [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    assert a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES, f"dtypes {a.dtype}, {b.dtype}"
    assert min(block_m, block_n, block_k) >= 16, "tl.dot needs tiles of at least 16 in every dim"
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)  # [M, N]
    if M == 0 or N == 0:
        return c
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    matmul_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return c


# ----------------------------------------------------------------------------------------------
# 4. causal_tile: the score tiles S = q k^T * scale of causal attention, -inf where a key is in
#    the future. Bottom-right alignment, as the engine's prefill kernel: the M queries are the
#    last M of the N positions, so query i sees keys j <= i + (N - M).
#
#     M = 3, N = 5          keys j ->  0 1 2 3 4
#     (N - M = 2)     query 0        [ s s s - - ]     s: q_i . k_j * scale
#                     query 1        [ s s s s - ]     -: -inf (j > i + 2)
#                     query 2        [ s s s s s ]
# ----------------------------------------------------------------------------------------------

def causal_tile_ref(q, k, scale):
    """q [M, D], k [N, D] -> float32 scores [M, N], -inf where j > i + (N - M)."""
    M, N = q.shape[0], k.shape[0]
    scores = (q.float() @ k.float().T) * scale  # [M, N]
    i = torch.arange(M, device=q.device)[:, None]
    j = torch.arange(N, device=q.device)[None, :]
    return scores.masked_fill(j > i + (N - M), float("-inf"))


@triton.jit
def causal_tile_kernel(
    q_ptr, k_ptr, s_ptr, M, N, D, stride_qm, stride_kn, stride_sm, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key rows
    offs_d = tl.arange(0, BLOCK_D)  # the whole head dim in one block (padded with zeros to BLOCK_D)
    q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :],  # [BLOCK_M, BLOCK_D]
                mask=(offs_m[:, None] < M) & (offs_d[None, :] < D), other=0.0)
    k = tl.load(k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :],  # [BLOCK_N, BLOCK_D]
                mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] float32
    future = offs_n[None, :] > offs_m[:, None] + (N - M)
    s = tl.where(future, float("-inf"), s)
    tl.store(s_ptr + offs_m[:, None] * stride_sm + offs_n[None, :], s,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def causal_tile(q, k, scale=None, block_m=32, block_n=32):
    """Triton version of `causal_tile_ref`: q [M, D], k [N, D] -> float32 scores [M, N].

    scale defaults to D ** -0.5. D up to 256 (one block holds a whole query or key row).
    """
    assert q.dim() == 2 and k.dim() == 2 and q.shape[1] == k.shape[1], (
        f"q must be [M, D] and k [N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    assert q.dtype == k.dtype and q.dtype in SUPPORTED_DTYPES, f"dtypes {q.dtype}, {k.dtype}"
    assert q.stride(1) == 1 and k.stride(1) == 1, "q and k must be contiguous in their last dim"
    (M, D), N = q.shape, k.shape[0]
    assert D <= 256, f"head dim {D} > 256"
    scale = D**-0.5 if scale is None else float(scale)
    s = torch.empty(M, N, dtype=torch.float32, device=q.device)  # [M, N]
    if M == 0 or N == 0:
        return s
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    causal_tile_kernel[grid](
        q, k, s, M, N, D, q.stride(0), k.stride(0), s.stride(0), scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return s
