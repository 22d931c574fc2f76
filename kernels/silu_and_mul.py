"""SwiGLU's activation as one elementwise kernel: out = silu(gate) * up over x = [gate | up].

A memory-bound op (read 2*d, write d values per token) where launch cost dominates at decode sizes.
vLLM: vllm/model_executor/layers/activation.py (SiluAndMul) and csrc/activation_kernels.cu
(act_and_mul_kernel).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def silu_and_mul_ref(x):
    """Naive reference. x: [num_tokens, 2 * d] -> [num_tokens, d] in x.dtype.

    Computed in float32 and rounded once, as the torch.compile'd layer did on CUDA (Inductor upcasts
    half-precision inputs); eager PyTorch in bf16 would round twice (after silu, after the product).
    """
    gate, up = x.float().chunk(2, dim=-1)  # each [num_tokens, d]
    return (F.silu(gate) * up).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Grid: (row tiles, column tiles). A program owns a [BLOCK_T, BLOCK_D] tile of the output and
# reads the matching tiles of gate and up, d columns apart in the same row:
#
#     x row t:   [ gate: 0 .. d-1 | up: d .. 2d-1 ]        out row t: [ 0 .. d-1 ]
#                  ^ col tile j          ^ col tile j (+d)              ^ col tile j
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_tokens"])  # one compiled variant for every batch size
def silu_and_mul_kernel(
    x_ptr, out_ptr, num_tokens, d, stride_x_t, stride_out_t,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (offs_t < num_tokens) & (offs_d < d)
    rows = offs_t.to(tl.int64)  # 64-bit row offsets: num_tokens * stride may pass 2**31
    gate = tl.load(x_ptr + rows * stride_x_t + offs_d, mask=mask, other=0.0)
    up = tl.load(x_ptr + rows * stride_x_t + d + offs_d, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    out = gate32 / (1.0 + tl.exp(-gate32)) * up.to(tl.float32)  # silu(g) * up in fp32 (as torch's silu)
    tl.store(out_ptr + rows * stride_out_t + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask)


def _tile_shape(num_tokens, d):
    """(BLOCK_T, BLOCK_D): tiles of >= 1024 elements, the Triton tutorials' elementwise block
    (8 per thread with 4 warps: one 16-byte load of bf16 per input).

    Columns first, up to 1024 a tile, so a decode batch still fills the GPU: 256 tokens x d=3072
    is 256 x 3 = 768 programs on an H200's 132 SMs. Narrow rows (d < 1024) stack rows to keep 1024
    elements a tile. From 4096 tokens on (prefill) a program takes 4x the rows: the grid still holds
    thousands of programs (>= 3072 at d=3072), each with 4 independent loads per input in flight.
    """
    block_d = min(1024, triton.next_power_of_2(d))
    block_t = max(1, 1024 // block_d) * (4 if num_tokens >= 4096 else 1)
    return block_t, block_d


def silu_and_mul(x):
    """Triton version of `silu_and_mul_ref`: x [num_tokens, 2 * d], rows may be strided (the last
    dim contiguous) -> a new contiguous [num_tokens, d] tensor in x.dtype.

    Never syncs with the host, so it can be captured in a CUDA graph.
    """
    assert x.dim() == 2, f"x must be [num_tokens, 2 * d], got shape {tuple(x.shape)}"
    num_tokens, two_d = x.shape
    assert two_d % 2 == 0, f"x's last dim must be even ([gate | up]), got {two_d}"
    assert x.dtype in SUPPORTED_DTYPES, f"x dtype {x.dtype} not supported (use one of {SUPPORTED_DTYPES})"
    assert x.stride(-1) == 1, f"x must be contiguous in its last dim (strides {x.stride()})"
    d = two_d // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)  # [num_tokens, d]
    if num_tokens == 0 or d == 0:
        return out
    block_t, block_d = _tile_shape(num_tokens, d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(d, block_d))
    silu_and_mul_kernel[grid](
        x, out, num_tokens, d, x.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return out
