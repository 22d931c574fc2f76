"""Chapter 13 exercise: FP8 e4m3 quantization with its scales (kernels/quant_fp8.py, kernels/fp8_gemm.py):
the KV cache's per-tensor scale, the rounding to e4m3 that the store kernels run in registers, and the
kernel that quantizes a GEMM's activations with one scale per token and group of columns. Write the
three bodies; `make exercise CH=13` runs the FP8 tests with them. Stuck?
chapters/exercises/hints/13_quantization.md, one level at a time.

They replace kv_scale_from_amax and quantize_fp8 of kernels/quant_fp8.py wherever the package uses them
(calculate_kv_scales, both KV store kernels, the activation kernel) and per_token_group_quant_fp8_kernel
of kernels/fp8_gemm.py, which its host wrapper per_token_group_quant_fp8 launches. The two Triton
functions are @triton.jit: use `tl.*` operations on blocks; on a CPU they run in Triton's interpreter,
so a `print(...)` inside shows values. Keep the signatures.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.quant_fp8 import FP8_DTYPE, FP8_MAX  # noqa: F401 (float8_e4m3fn, 448.0)


def kv_scale_from_amax(x: torch.Tensor) -> torch.Tensor:
    """Exercise 13.1, the per-tensor scale: the scale that maps x's largest magnitude onto FP8_MAX
    (448), what calculate_kv_scales gives a layer's K and V (chapter 13, "The format: e4m3 with a
    per-tensor scale").

    x: any float tensor. Returns [1] float32 on x's device, computed there: no .item() or other host
    sync (the engine calls it inside a step). An all-zero x gets 1.0 (its codes are 0 whatever the scale).
    """
    raise NotImplementedError("exercise 13.1 (kv_scale_from_amax) is not written yet: fill it in, "
                              "chapters/exercises/ex13_quantization.py; read chapters/13_quantization.md, "
                              "'The format: e4m3 with a per-tensor scale'")


@triton.jit
def quantize_fp8(x, scale):
    """Exercise 13.1, the codes: x / scale as float8_e4m3fn codes, bit for bit what torch gives
    (quantize_fp8_ref: (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)); chapter 13, "The
    format: e4m3 with a per-tensor scale" and "Where the (de)quantization happens".

    x: a block of float32/16-bit values; scale: a float32 scalar. Returns a block of tl.float8e4nv.
    - y = x / scale in float32, rounded as IEEE division (tl.div_rn; a plain `/` may be approximate on
      a GPU), saturated to [-448, 448], the largest e4m3 magnitude (a plain cast would give NaN past it).
    - y rounded to the nearest e4m3 value, ties to even. e4m3 keeps 3 mantissa bits: for |y| >= 2^-6
      (normal numbers) the rounding keeps the top 3 of float32's 23 mantissa bits; below 2^-6
      (subnormals) the e4m3 values are the multiples of 2^-9. y's sign stays, -0.0 included.
    - Only then the cast to tl.float8e4nv, of a value it represents exactly. (Casting y directly is
      right on a GPU, but Triton's interpreter rounds ties away from zero and mis-rounds a carry into
      the exponent: the tests on a CPU compare bit for bit.) A bitcast, y.to(tl.int32, bitcast=True),
      gives the bits to work on.
    """
    raise NotImplementedError("exercise 13.1 (quantize_fp8) is not written yet: fill it in, "
                              "chapters/exercises/ex13_quantization.py; read chapters/13_quantization.md, "
                              "'The format: e4m3 with a per-tensor scale'")


@triton.jit
def per_token_group_quant_fp8_kernel(
    x_ptr, codes_ptr, scales_ptr, num_cols, stride_x_m, stride_codes_m, stride_scales_m,
    GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    """Exercise 13.1, the activation kernel: dynamic per-token-group quantization, the activations'
    half of W8A8 (chapter 13, "FP8 weights (W8A8)"); the codes and scales of
    per_token_group_quant_fp8_ref, bit for bit.

    Grid (num_rows, num_groups): program (m, g) quantizes columns [g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
    of row m of x (the last group may be cut short by num_cols). x: [num_rows, num_cols] of float32,
    float16 or bfloat16, row m at x_ptr + m * stride_x_m, columns contiguous; codes: float8_e4m3fn,
    the same shape, row m at codes_ptr + m * stride_codes_m; scales: float32 [num_rows, num_groups],
    row m at scales_ptr + m * stride_scales_m. BLOCK: GROUP_SIZE rounded up to a power of two
    (tl.arange needs one). Row offsets can pass 2**31 elements: compute them in int64.
    The group's scale is amax / 448 (amax: the group's largest magnitude in float32, but at least
    MIN_AMAX, so that an all-zero group gets a finite scale and codes 0), an IEEE division (tl.div_rn);
    its codes are quantize_fp8(x, scale) (yours, above). Columns outside the group are neither read nor
    written.
    """
    raise NotImplementedError("exercise 13.1 (per_token_group_quant_fp8_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex13_quantization.py; read chapters/13_quantization.md, "
                              "'FP8 weights (W8A8)'")
