"""W8A8 FP8 matmul: y = (a * a_scale) @ (b * b_scale)^T with a, b float8_e4m3fn and float32 scales
that each cover a block of the matrix, accumulated in float32, written in bf16 (or fp16/fp32).

    block-FP8 (DeepSeek-V3 / Qwen3-FP8 checkpoints)     per-channel (quantized at load time)
    a [M, K]: one scale per token and 128 columns       a [M, K]: one scale per token
    b [N, K]: one scale per 128 x 128 block             b [N, K]: one scale per output row

Both are one function of block sizes: per-channel is block_size = [1, K] for b and a group of K
columns for a. The references dequantize, then matmul in float32; the Triton kernel multiplies the
float32 partial product of each K tile by its two scales, so it never dequantizes a whole matrix.
vLLM: vllm/model_executor/layers/quantization/utils/fp8_utils.py (w8a8_block_fp8_matmul,
per_token_group_quant_fp8) and vllm/_custom_ops.py (cutlass_scaled_mm).
"""
import torch
import triton
import triton.language as tl

from ._common import num_sms
from .quant_fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8, quantize_fp8_ref

# A block of zeros gets this amax, not 0: the scale stays finite and its codes are 0.
MIN_AMAX = 1e-10
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- references

def _expand_scales(scales: torch.Tensor, shape, block_rows: int, block_cols: int) -> torch.Tensor:
    """One scale per block_rows x block_cols block -> one per element of a `shape` matrix (the last
    blocks may be partial: ceil-sized scale grids, as the checkpoints store them)."""
    rows, cols = shape
    return scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def quantize_fp8_blocks_ref(x: torch.Tensor, block_rows: int, block_cols: int):
    """x [R, C] -> (codes [R, C] float8_e4m3fn, scales [ceil(R/br), ceil(C/bc)] float32): each block's
    largest magnitude lands on 448, and x ~= code * scale of its block.

    Per-token: (1, C); per-token-group: (1, 128); per-output-channel weights: (1, C); block weights:
    (128, 128). The scale is amax / 448 as a tensor division (IEEE on every backend, as the kernel's)."""
    rows, cols = x.shape
    num_r, num_c = -(-rows // block_rows), -(-cols // block_cols)
    padded = x.new_zeros(num_r * block_rows, num_c * block_cols, dtype=torch.float32)
    padded[:rows, :cols] = x.float()
    amax = padded.view(num_r, block_rows, num_c, block_cols).abs().amax(dim=(1, 3))  # [num_r, num_c]
    scales = amax.clamp(min=MIN_AMAX) / torch.tensor(FP8_MAX, device=x.device)
    codes = quantize_fp8_ref(x, _expand_scales(scales, x.shape, block_rows, block_cols))
    return codes, scales


def dequantize_fp8_blocks_ref(codes: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int,
                              dtype=torch.float32) -> torch.Tensor:
    """codes [R, C] * the scale of each element's block, in `dtype`."""
    return (codes.float() * _expand_scales(scales, codes.shape, block_rows, block_cols)).to(dtype)


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int):
    """Dynamic activation quantization: x [M, K] -> (codes [M, K], scales [M, ceil(K/group_size)])."""
    return quantize_fp8_blocks_ref(x, 1, group_size)


def w8a8_block_fp8_matmul_ref(a, a_scale, b, b_scale, block_size, output_dtype=torch.bfloat16):
    """Dequantize both operands in float32, matmul, round once to output_dtype.

    a [M, K] fp8, a_scale [M, ceil(K/bk)]; b [N, K] fp8, b_scale [ceil(N/bn), ceil(K/bk)];
    block_size = [bn, bk]. Returns [M, N]."""
    block_n, block_k = block_size
    a_float = dequantize_fp8_blocks_ref(a, a_scale, 1, block_k)  # [M, K]
    b_float = dequantize_fp8_blocks_ref(b, b_scale, block_n, block_k)  # [N, K]
    return (a_float @ b_float.t()).to(output_dtype)


# ----------------------------------------------------------------------------- activation quant

@triton.jit
def per_token_group_quant_fp8_kernel(
    x_ptr, codes_ptr, scales_ptr, num_cols, stride_x_m, stride_codes_m, stride_scales_m,
    GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    """Grid (rows, groups): one program quantizes GROUP_SIZE columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x_m + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX)
    scale = tl.div_rn(amax, 448.0)  # IEEE division, as the reference's
    tl.store(codes_ptr + row * stride_codes_m + cols, quantize_fp8(x, scale), mask=mask)
    tl.store(scales_ptr + row * stride_scales_m + group, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int):
    """Triton version of `per_token_group_quant_fp8_ref` (the same codes, bit for bit): x [M, K] in
    bf16/fp16/fp32, contiguous in K -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K/group_size)]
    float32). group_size = K gives one scale per token. No host sync (CUDA-graph safe)."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [M, K] contiguous in K, got {tuple(x.shape)} {x.stride()}"
    assert x.dtype in OUTPUT_DTYPES, f"x dtype {x.dtype} not supported"
    num_rows, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group_size)
    codes = torch.empty(num_rows, num_cols, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return codes, scales
    block = triton.next_power_of_2(group_size)
    per_token_group_quant_fp8_kernel[(num_rows, num_groups)](
        x, codes, scales, num_cols, x.stride(0), codes.stride(0), scales.stride(0),
        GROUP_SIZE=group_size, BLOCK=block, MIN_AMAX=MIN_AMAX, num_warps=min(8, max(1, block // 256)))
    return codes, scales


# ----------------------------------------------------------------------------- block-scaled GEMM
#
# Grid: one program per [BLOCK_M, BLOCK_N] output tile (ordered in groups of GROUP_SIZE_M tile rows
# so neighbouring programs share B tiles in L2, as in the Triton matmul tutorial). It walks K in
# tiles of BLOCK_K that lie inside one scale group, so each tile's product needs one scale per row
# of a and one per column of b:
#
#     acc[m, n] += (sum_k a[m, k] b[n, k]) * a_scale[m, k // bk] * b_scale[n // bn, k // bk]
#                   ^ fp8 x fp8 tensor-core dot, fp32 result

@triton.jit(do_not_specialize=["M"])  # one compiled variant per tile config, whatever the batch size
def w8a8_block_fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Rows and columns past the edge wrap around (always in bounds); their results are not stored.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_as_m  # [BLOCK_M]
    b_scale_ptrs = b_scale_ptr + (offs_n // GROUP_N) * stride_bs_n  # [BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        group = (k * BLOCK_K) // GROUP_K
        a_scale = tl.load(a_scale_ptrs + group * stride_as_k)
        b_scale = tl.load(b_scale_ptrs + group * stride_bs_k)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def gemm_config(M: int, N: int, K: int, block_k: int, num_sms: int = 1) -> dict:
    """Tile sizes by the number of tokens. Decode (M <= 64) is the weight read: the N tiles narrow
    (128 -> 64 -> 32 columns) until there is a program for every SM, so all of them stream B (an
    8B-shaped o_proj, N = 4096, at 128 columns would keep 32 of an H200's 132 SMs busy). Prefill
    (large M) takes 128 x 128 tiles, the tensor cores' sweet spot. BLOCK_K is the scale group
    (128): one K tile, one pair of scales. fp8 tiles are 1 byte per element, so 4-5 stages of
    64 x 128 + 128 x 128 fit in shared memory easily."""
    if M <= 64:
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n = 128
        while block_n > 32 and triton.cdiv(N, block_n) * triton.cdiv(M, block_m) < num_sms:
            block_n //= 2
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=5 if block_m == 16 else 4)
    elif M <= 256:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(cfg, BLOCK_K=min(block_k, 128), GROUP_SIZE_M=8)


def w8a8_block_fp8_matmul(a, a_scale, b, b_scale, block_size, output_dtype=torch.bfloat16, config=None):
    """Triton version of `w8a8_block_fp8_matmul_ref`: a [M, K] fp8 with a_scale [M, ceil(K/bk)];
    b [N, K] fp8 with b_scale [ceil(N/bn), ceil(K/bk)]; block_size = [bn, bk] -> [M, N] output_dtype.

    config: tile sizes (see `gemm_config`; for tuning). No host sync (CUDA-graph safe)."""
    block_n, block_k = block_size
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], (
        f"a must be [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE, f"a and b must be {FP8_DTYPE}, got {a.dtype}, {b.dtype}"
    assert a.stride(-1) == 1 and b.stride(-1) == 1, "a and b must be contiguous in K"
    assert output_dtype in OUTPUT_DTYPES, f"output_dtype must be one of {OUTPUT_DTYPES}"
    M, K = a.shape
    N = b.shape[0]
    assert block_k >= 16 and block_k & (block_k - 1) == 0, f"the K block must be a power of two >= 16, got {block_k}"
    assert a_scale.shape == (M, triton.cdiv(K, block_k)) and a_scale.dtype == torch.float32, (
        f"a_scale must be [M, ceil(K/{block_k})] = {(M, triton.cdiv(K, block_k))} float32, "
        f"got {tuple(a_scale.shape)} {a_scale.dtype}")
    assert b_scale.shape == (triton.cdiv(N, block_n), triton.cdiv(K, block_k)) and b_scale.dtype == torch.float32, (
        f"b_scale must be [ceil(N/{block_n}), ceil(K/{block_k})] float32, got {tuple(b_scale.shape)} {b_scale.dtype}")
    c = torch.empty(M, N, dtype=output_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    cfg = config or gemm_config(M, N, K, block_k, num_sms(a.device.index) if a.is_cuda else 1)
    assert block_k % cfg["BLOCK_K"] == 0, "a K tile must lie inside one scale group"
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    w8a8_block_fp8_matmul_kernel[grid](
        a, b, c, a_scale, b_scale, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        GROUP_N=block_n, GROUP_K=block_k, **cfg)
    return c


def scaled_mm_per_channel(a, a_scale, b, b_scale, output_dtype=torch.bfloat16, bias=None):
    """torch._scaled_mm (cuBLASLt FP8 GEMM with row-wise scales): a [M, K] fp8 with a_scale [M, 1]
    (per token); b [N, K] fp8 with b_scale [N, 1] (per output channel) -> [M, N]. cuBLASLt wants b
    column-major: b.t() of a row-major [N, K] is exactly that, no copy. Row-wise scales need a bf16
    output."""
    return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.view(1, -1), bias=bias,
                            out_dtype=output_dtype)
