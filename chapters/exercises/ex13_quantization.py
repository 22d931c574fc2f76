"""Chapter 13 exercise: quantizing to FP8 e4m3 in registers (kernels/quant_fp8.py), as the store
kernels do for every K/V element they write. Write the function's body; `make exercise CH=13`
runs the FP8 kernel tests with it.

It is a @triton.jit device function: use `tl.*` operations on blocks. On a CPU it runs in Triton's
interpreter, so a `print(...)` inside shows values. Keep the signature.
"""
import triton
import triton.language as tl


@triton.jit
def quantize_fp8(x, scale):
    """Exercise 13.1: x / scale as float8_e4m3fn codes, bit for bit what torch gives
    (quantize_fp8_ref: (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)); chapter 13,
    "The format: e4m3 with a per-tensor scale" and "Where the (de)quantization happens".

    x: a block of float32/16-bit values; scale: a float32 scalar. Steps:
    1. y = x / scale in float32 with IEEE rounding (tl.div_rn; a plain `/` may be approximate on a
       GPU), clamped to [-448, 448] (tl.clamp), the largest e4m3 magnitude: a plain cast would
       give NaN past it.
    2. Round y to the nearest e4m3 value, ties to even. e4m3 keeps 3 mantissa bits: for |y| >= 2^-6
       (normal numbers) that is float32's 23 mantissa bits rounded to their top 3 (work on the bits:
       y.to(tl.int32, bitcast=True); a carry out of the mantissa correctly bumps the exponent);
       below 2^-6 (subnormals) the values are multiples of 2^-9. Keep y's sign, -0.0 included.
    3. Cast the rounded float32 to tl.float8e4nv: the value is now exactly representable, so the
       cast cannot round. (Casting y directly is right on a GPU, but Triton's interpreter rounds
       ties away from zero: the bit-for-bit test on a CPU needs step 2.)
    """
    raise NotImplementedError("exercise 13.1 (quantize_fp8) is not written yet: fill it in, "
                              "chapters/exercises/ex13_quantization.py; read chapters/13_quantization.md, "
                              "'The format: e4m3 with a per-tensor scale'")
