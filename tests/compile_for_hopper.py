"""Compile kernels for an sm_90 GPU (Hopper: H100, H200) on a machine without one, as a GPU would at
its first call: Triton's front end, its passes and ptxas run, no device. The interpreter that runs the
kernels on a CPU checks none of what only the compiler checks (constexpr globals, types, layouts).

    python tests/compile_for_hopper.py gemv    # prints one line per compiled variant; exits 1 on a failure
    python tests/compile_for_hopper.py decode --stats [--json FILE]   # and each variant's registers,
                                                                      # shared memory and SASS mix
    python tests/compile_for_hopper.py moe --stats    # the fused-MoE kernels at the tuner's tiles

Run in a process without TRITON_INTERPRET (tests/test_kernels_gemv.py starts it so). --stats reads the
cubin with the cuobjdump that ships with Triton: registers a thread (what bounds programs per SM),
shared memory a program, and counts of the instructions that say what the compiler did with the
loads (LDG: a global load into registers; LDGSTS: an asynchronous copy into shared memory, the
software pipeline's), the dots (HMMA, HGMMA), FP8 conversions (F2FP), shared-memory stores (STS) and reads (LDS; LDSM,
ldmatrix: four 8 x 8 matrices an instruction).
"""
import argparse
import collections
import datetime
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_variant(fn, pointer_types: dict, scalar_types: dict, constexprs: dict, num_warps: int = 4,
                    num_stages: int = 3, aligned=()):
    """Compile `fn` for HOPPER with these argument types and constexpr values (names of fn's arguments);
    `aligned` names the arguments a launch would find divisible by 16 (pointers 16-byte aligned, strides
    multiples of 16), as Triton's launcher specializes them: what lets the compiler vectorize the loads."""
    signature, values, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
        else:
            signature[name] = pointer_types.get(name) or scalar_types[name]
            if name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs), target=HOPPER,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def gemv_variants():
    """The GEMV kernel's variants the engine can launch: every prologue, bias or not, split-K or not,
    dots or not (float32: at full precision), one row and a tile of 16, in bf16, fp16 and fp32."""
    gemv = importlib.import_module("minivllm.kernels.gemv")
    for dtype, prologue, has_bias, split_k, dot, block_m in itertools.product(
            ("bf16", "fp16", "fp32"), range(len(gemv.PROLOGUES)), (False, True), (1, 4), (False, True), (1, 16)):
        if dot and block_m < 16:
            continue  # (the wrapper pads a tensor-core tile to 16 rows)
        pointers = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "res_ptr", "res_out_ptr",
                                                   "norm_w_ptr")}
        pointers.update(partial_ptr="*fp32", counter_ptr="*i32")
        scalars = {name: "i32" for name in ("M", "N", "K", "k_per_split", "stride_x", "stride_res", "stride_sum",
                                            "stride_w", "stride_out")}
        scalars["eps"] = "fp32"
        constexprs = dict(PROLOGUE=prologue, HAS_BIAS=has_bias, SPLIT_K=split_k, DOT=dot, BLOCK_M=block_m,
                          BLOCK_N=64 if dot else 4, BLOCK_K=1024 if block_m == 1 else 64)
        aligned = set(pointers) | (set(scalars) - {"M", "eps"})  # a model's widths: multiples of 16 (M, eps: never)
        name = f"gemv {dtype} {gemv.PROLOGUES[prologue]} bias={has_bias} split_k={split_k} dot={dot} M<={block_m}"
        yield name, lambda p=pointers, s=scalars, c=constexprs, a=aligned: compile_variant(gemv.gemv_kernel, p, s, c,
                                                                                          aligned=a)


def _moe_small_signatures(dtype, ids):
    """(pointer types, scalar types) of the few-pairs gate_up and down kernels."""
    gate_up = ({"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "topk_ids_ptr": f"*{ids}"},
               dict.fromkeys(("N", "K", "num_experts", "stride_xm", "stride_we", "stride_wn", "stride_am"), "i32"))
    down = ({"act_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "topk_weights_ptr": "*fp32",
             "topk_ids_ptr": f"*{ids}"},
            dict.fromkeys(("N", "K", "num_experts", "stride_am", "stride_we", "stride_wk", "stride_om"), "i32"))
    return gate_up, down


def moe_small_variants():
    """The few-pairs fused-MoE kernels (kernels/fused_moe.py) in bf16 and fp16, int32 and int64 ids, a sum
    per step and the products summed once."""
    moe = importlib.import_module("minivllm.kernels.fused_moe")
    for dtype, ids, once in itertools.product(("bf16", "fp16"), ("i32", "i64"), (False, True)):
        tiles = dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256, SUM_ONCE=once)
        gate_up, down = _moe_small_signatures(dtype, ids)
        form = " sum once" if once else ""
        yield (f"moe few-pairs gate_up {dtype} ids {ids}{form}",
               lambda a=gate_up, t=tiles: compile_variant(moe.fused_moe_small_gate_up_kernel, *a, t))
        yield (f"moe few-pairs down {dtype} ids {ids}{form}",
               lambda a=down, t=tiles: compile_variant(moe.fused_moe_small_down_kernel, *a, t))


def moe_variants():
    """The fused-MoE kernels at Qwen3-30B-A3B's top-8 in bf16 (int64 ids) for --stats, at the tiles the
    tuner weighs: the few-pairs path in both forms, and the aligned path's tiles with the weights' unit
    stride specialized to 1 as a launch specializes it (what lets its loads vectorize)."""
    moe = importlib.import_module("minivllm.kernels.fused_moe")
    gate_up, down = _moe_small_signatures("bf16", "i64")
    for config in (moe.SmallMoEConfig(8, 256), moe.SmallMoEConfig(8, 256, 4, True), moe.SmallMoEConfig(4, 512, 4, True),
                   moe.SmallMoEConfig(2, 1024, 4, True)):
        tiles = dict(TOP_K=8, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, SUM_ONCE=config.sum_once)
        name = f"{config.BLOCK_N}x{config.BLOCK_K} w{config.num_warps}" + (" sum once" if config.sum_once else "")
        for kernel, (pointers, scalars) in (("gate_up", gate_up), ("down", down)):
            fn = getattr(moe, f"fused_moe_small_{kernel}_kernel")
            yield (f"moe few-pairs {kernel} {name}",
                   lambda fn=fn, a=(pointers, scalars), t=tiles, w=config.num_warps: compile_variant(
                       fn, *a, t, num_warps=w, aligned=[n for n in (*a[0], *a[1]) if n != "num_experts"]))
    ids = {"sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"}
    aligned_gate_up = ({"x_ptr": "*bf16", "w13_ptr": "*bf16", "act_ptr": "*bf16", **ids},
                       dict.fromkeys(("num_pairs", "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_am"), "i32"),
                       {"TOP_K": 8, "stride_wk": 1})
    aligned_down = ({"act_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16", "topk_weights_ptr": "*fp32", **ids},
                    dict.fromkeys(("num_pairs", "N", "K", "stride_am", "stride_we", "stride_wk", "stride_om"), "i32"),
                    {"stride_wn": 1})
    for config in (moe.MoEConfig(16, 64, 128, 1, 4, 3), moe.MoEConfig(64, 128, 64, 8, 4, 3),
                   moe.MoEConfig(64, 256, 64, 8, 8, 3), moe.MoEConfig(128, 128, 64, 8, 8, 3)):
        tiles = dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, GROUP_M=config.GROUP_M)
        name = (f"{config.BLOCK_M}x{config.BLOCK_N}x{config.BLOCK_K} w{config.num_warps} s{config.num_stages}")
        for kernel, (pointers, scalars, fixed) in (("gate_up", aligned_gate_up), ("down", aligned_down)):
            fn = getattr(moe, f"fused_moe_{kernel}_kernel")
            yield (f"moe aligned {kernel} {name}",
                   lambda fn=fn, a=(pointers, scalars), t={**tiles, **fixed}, c=config: compile_variant(
                       fn, *a, t, num_warps=c.num_warps, num_stages=c.num_stages,
                       aligned=[n for n in (*a[0], *a[1]) if n != "num_pairs"]))


def decode_variants():
    """The paged-decode kernel (kernels/paged_decode.py) with splits, bf16 q over a bf16 cache and over an
    FP8 one (the conversion instruction and the integer bits), dots padded to 16 and 64 rows; the tiles
    loaded by the compiler's 2-stage pipeline and by no pipeline (1 stage)."""
    decode = importlib.import_module("minivllm.kernels.paged_decode")
    for cache, rows, stages in itertools.product(("bf16", "fp8 cvt", "fp8 bits"), (16, 64), (2, 1)):
        kv = {"bf16": "*bf16", "fp8 cvt": "*fp8e4nv", "fp8 bits": "*u8"}[cache]
        pointers = dict(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, out_ptr="*fp32", lse_ptr="*fp32",
                        cache_seqlens_ptr="*i32", block_table_ptr="*i32", seq_order_ptr="*i32", k_descale_ptr="*fp32",
                        v_descale_ptr="*fp32", final_ptr="*bf16", counter_ptr="*i32")
        scalars = {name: "i32" for name in decode.paged_decode_kernel.arg_names if name.startswith("stride_")}
        scalars.update(qk_scale="fp32", seqlen_q="i32", group_size="i32", block_size="i32", min_split_tokens="i32")
        fp8 = cache != "bf16"
        constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=rows, BLOCK_N=64, CAUSAL=False, SPLIT=True,
                          HAS_ORDER=False, KV_FP8=fp8, DOT_FP16=fp8, FP8_BITS=cache == "fp8 bits", FUSED_MERGE=False,
                          SPLITS_PAD=2)
        # what an engine launch finds divisible by 16: the pointers and the strides of q, the caches and the
        # outputs (head_dim 128); not the block table's or the log-sum-exps' (any number of blocks, splits)
        aligned = set(pointers) | {name for name in scalars if name[:8] in ("stride_q", "stride_k", "stride_v",
                                                                          "stride_o", "stride_f")}
        name = f"decode {cache} cache rows {rows} stages {stages}"
        yield name, lambda p=pointers, s=scalars, c=constexprs, a=aligned, n=stages: compile_variant(
            decode.paged_decode_kernel, p, s, c, num_stages=n, aligned=a)


PLANTED_LIMIT = 4  # a plain int global: what a compiled kernel may not read


@triton.jit
def _planted_kernel(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, offs + PLANTED_LIMIT)


def planted_variants():
    """A kernel that must fail to compile (the check is not vacuous)."""
    yield "planted plain-int global", lambda: compile_variant(_planted_kernel, {"x_ptr": "*i32"}, {}, {"N": 16})


VARIANTS = {"gemv": gemv_variants, "moe-small": moe_small_variants, "moe": moe_variants, "decode": decode_variants,
            "planted": planted_variants}


SASS_OPS = ("LDG", "LDGSTS", "STS", "LDS", "LDSM", "HMMA", "HGMMA", "F2FP", "BAR", "STL", "LDL")  # by opcode
# (modifiers aside); STL / LDL: local memory, registers spilled


def sass_stats(kernel) -> dict:
    """Registers a thread, shared memory a program and the SASS instruction mix of a compiled kernel."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        raise FileNotFoundError(f"--stats reads the cubin with {cuobjdump}, which this Triton lacks")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, timeout=60).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=60).stdout
    opcodes = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, flags=re.M)
    counts = collections.Counter(op.split(".")[0] for op in opcodes)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "shared_bytes": kernel.metadata.shared,
            "instructions": len(opcodes), "counts": {op: counts[op] for op in SASS_OPS}}


def format_stats(stats: dict) -> str:
    mix = " ".join(f"{op} {n}" for op, n in stats["counts"].items() if n)
    return f"regs {stats['registers']}, shared {stats['shared_bytes']} B, {stats['instructions']} instructions: {mix}"


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernels", nargs="*", choices=[[], *VARIANTS], default=["gemv"])
    parser.add_argument("--stats", action="store_true", help="each variant's registers, shared memory, SASS mix")
    parser.add_argument("--json", metavar="FILE", help="with --stats: also write them to FILE")
    args = parser.parse_args(argv)
    failed, stats = 0, []
    for kernel in args.kernels or ["gemv"]:
        for name, build in VARIANTS[kernel]():
            try:
                compiled = build()
                row = {"variant": name, **sass_stats(compiled)} if args.stats else None
                print(f"ok     {name}" + (f": {format_stats(row)}" if row else ""), flush=True)
                stats += [row] if row else []
            except Exception as exc:  # every variant is tried; the report names each failure
                failed += 1
                print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    if args.json and stats:
        with open(args.json, "w") as f:
            json.dump({"target": f"cuda sm_{HOPPER.arch}", "triton": triton.__version__, "python": sys.version.split()[0],
                       "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "counts": "SASS instructions by opcode (modifiers aside), the whole kernel, not per tile",
                       "variants": stats}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
