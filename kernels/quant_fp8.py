"""FP8 (float8_e4m3fn) quantization of the KV cache with one scale per tensor.

A cache element holds the FP8 code of x / scale (saturated to +-448, the largest e4m3 value);
readers recover x ~= code * scale. The references here are what every kernel's FP8 path is tested
against, and `quantize_fp8` is the store kernels' in-register version.
vLLM: vllm/_custom_ops.py (scaled_fp8_quant), csrc/quantization/fp8/ and the kv_cache_dtype paths
of csrc/cache_kernels.cu.
"""
import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn  # vLLM's "fp8" / "fp8_e4m3": 4 exponent bits, 3 mantissa bits, no inf
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale rounded to the nearest e4m3 value, saturated at +-448 (a plain cast would give NaN).

    The scale becomes a tensor on x's device first: torch divides by a Python number as a multiply
    by its reciprocal on CUDA, which rounds differently from the IEEE division the kernels do."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8_ref(codes: torch.Tensor, scale: torch.Tensor | float, dtype=torch.float32) -> torch.Tensor:
    """code * scale, in `dtype`."""
    return (codes.float() * scale).to(dtype)


def kv_scale_from_amax(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale that maps x's largest magnitude onto FP8_MAX: [1] float32, on x's device
    (no host sync). An all-zero tensor gets scale 1.0."""
    amax = x.detach().abs().amax().float().reshape(1)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def check_kv_scale(name, scale, cache):
    """An FP8 cache needs its scale ([1] float32 on the cache's device); any other cache takes none."""
    if not is_fp8(cache.dtype):
        assert scale is None, f"{name} is only for an FP8 cache (the cache is {cache.dtype})"
        return
    assert scale is not None, f"an FP8 cache ({cache.dtype}) needs {name} ([1] float32)"
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale.device == cache.device, (
        f"{name} must be [1] float32 on {cache.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")


@triton.jit
def quantize_fp8(x, scale):
    """In registers: x / scale, saturated and rounded to the nearest e4m3 value, ties to even, as
    quantize_fp8_ref. The rounding is spelled out in float32 so the final cast is exact: the codes
    then match torch's bit for bit on any backend (the Triton interpreter's own fp32 -> fp8 cast
    rounds ties away from zero and loses the carry into the exponent, 124.0 -> 64.0)."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)  # div_rn: IEEE division
    # Normal range (|y| >= 2^-6): keep 3 of float32's 23 mantissa bits, rounding the other 20 to
    # nearest even; a carry out of the mantissa correctly bumps the exponent.
    bits = y.to(tl.int32, bitcast=True)  # < 0 iff the sign bit is set (-0.0 too)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal range: a fixed step of 2^-9. Adding 1.5 * 2^14 (whose float32 ulp is 2^-9) makes the
    # hardware add round |y| to that step; subtracting it back is exact; the sign bit goes back on
    # last, as a bit (compiled, `-x` is `0 - x`, which turns -0.0 into +0.0).
    subnormal = (tl.abs(y) + 24576.0) - 24576.0
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal).to(tl.float8e4nv)
