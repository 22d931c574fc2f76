"""Compile kernels for an sm_90 GPU (Hopper: H100, H200) on a machine without one, as a GPU would at
its first call: Triton's front end, its passes and ptxas run, no device. The interpreter that runs the
kernels on a CPU checks none of what only the compiler checks (constexpr globals, types, layouts).

    python tests/compile_for_hopper.py gemv    # prints one line per compiled variant; exits 1 on a failure

Run in a process without TRITON_INTERPRET (tests/test_kernels_gemv.py starts it so).
"""
import importlib
import itertools
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_variant(fn, pointer_types: dict, scalar_types: dict, constexprs: dict, num_warps: int = 4):
    """Compile `fn` for HOPPER with these argument types and constexpr values (names of fn's arguments)."""
    signature, values = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
        else:
            signature[name] = pointer_types.get(name) or scalar_types[name]
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values), target=HOPPER,
                          options={"num_warps": num_warps})


def gemv_variants():
    """The GEMV kernel's variants the engine can launch: every prologue, bias or not, split-K or not,
    tensor-core tiles or not, one row and a tile of 16, in bf16 and fp16; and in bf16 each with its
    weight tiles loaded a K step ahead (PREFETCH)."""
    gemv = importlib.import_module("minivllm.kernels.gemv")
    for dtype, prologue, has_bias, split_k, dot, block_m, prefetch in itertools.product(
            ("bf16", "fp16"), range(len(gemv.PROLOGUES)), (False, True), (1, 4), (False, True), (1, 16), (False, True)):
        if dot and block_m < 16:
            continue  # (the wrapper pads a tensor-core tile to 16 rows)
        if prefetch and dtype != "bf16":
            continue
        pointers = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "res_ptr", "res_out_ptr",
                                                   "norm_w_ptr")}
        pointers.update(partial_ptr="*fp32", counter_ptr="*i32")
        scalars = {name: "i32" for name in ("M", "N", "K", "k_per_split", "stride_x", "stride_res", "stride_sum",
                                            "stride_w", "stride_out")}
        scalars["eps"] = "fp32"
        constexprs = dict(PROLOGUE=prologue, HAS_BIAS=has_bias, SPLIT_K=split_k, DOT=dot, BLOCK_M=block_m,
                          BLOCK_N=64 if dot else 4, BLOCK_K=1024 if block_m == 1 else 64, PREFETCH=prefetch)
        name = (f"gemv {dtype} {gemv.PROLOGUES[prologue]} bias={has_bias} split_k={split_k} dot={dot} M<={block_m}"
                + " prefetch" * prefetch)
        yield name, lambda p=pointers, s=scalars, c=constexprs: compile_variant(gemv.gemv_kernel, p, s, c)


def moe_small_variants():
    """The few-pairs fused-MoE kernels (kernels/fused_moe.py) in bf16 and fp16, int32 and int64 ids."""
    moe = importlib.import_module("minivllm.kernels.fused_moe")
    for dtype, ids in itertools.product(("bf16", "fp16"), ("i32", "i64")):
        tiles = dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256)
        gate_up = ({"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "topk_ids_ptr": f"*{ids}"},
                   dict.fromkeys(("N", "K", "num_experts", "stride_xm", "stride_we", "stride_wn", "stride_am"), "i32"))
        down = ({"act_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "topk_weights_ptr": "*fp32",
                 "topk_ids_ptr": f"*{ids}"},
                dict.fromkeys(("N", "K", "num_experts", "stride_am", "stride_we", "stride_wk", "stride_om"), "i32"))
        yield (f"moe few-pairs gate_up {dtype} ids {ids}",
               lambda a=gate_up: compile_variant(moe.fused_moe_small_gate_up_kernel, *a, tiles))
        yield (f"moe few-pairs down {dtype} ids {ids}",
               lambda a=down: compile_variant(moe.fused_moe_small_down_kernel, *a, tiles))


PLANTED_LIMIT = 4  # a plain int global: what a compiled kernel may not read


@triton.jit
def _planted_kernel(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, offs + PLANTED_LIMIT)


def planted_variants():
    """A kernel that must fail to compile (the check is not vacuous)."""
    yield "planted plain-int global", lambda: compile_variant(_planted_kernel, {"x_ptr": "*i32"}, {}, {"N": 16})


VARIANTS = {"gemv": gemv_variants, "moe-small": moe_small_variants, "planted": planted_variants}


def main(argv) -> int:
    failed = 0
    for kernel in argv or ["gemv"]:
        for name, build in VARIANTS[kernel]():
            try:
                build()
                print(f"ok     {name}", flush=True)
            except Exception as exc:  # every variant is tried; the report names each failure
                failed += 1
                print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
