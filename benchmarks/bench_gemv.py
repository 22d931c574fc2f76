"""The linear layers of a decode step at batch 1 to 16, paired: the ops the engine runs today (the norm or
SiLU kernel, then the cuBLAS GEMM), the cuBLAS GEMM alone, and our small-batch GEMV with that op in its
prologue (kernels/gemv.py), at the Qwen3-0.6B shapes; each beside the time its bytes take at the copy
bandwidth measured in the same run. The layer rows add up one decoder layer's four linears.
vLLM: benchmarks/kernels/benchmark_layernorm.py and the cuBLAS GEMMs it leaves to torch.

    python -m benchmarks.bench_gemv [--batches 1,2,4,8,16] [--no-cuda-graph]
    python -m benchmarks.bench_gemv --tiny      # CPU, the Triton interpreter, seconds
    python -m benchmarks.bench_gemv --sweep --batches 1,4,16   # also time SWEEP_TILES x split-K per case
    python -m benchmarks.bench_gemv --model smollm2-135m --dtype float32 --batches 5 --sweep --sweep-dot both \
        --sweep-tiles 4x128x4,16x128x4 --sweep-splits 1,2    # a float32 verify step's 5 rows, both paths
"""
import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from benchmarks import common

NAME = "bench_gemv"
# name -> (prologue, N, K, output dtype): one decoder layer's linears in the order a step runs them,
# then the LM head (float32 logits), for tensor_parallel_size 1
MODEL_SHAPES = {
    "0.6b": {"qkv": ("add_rms_norm", 4096, 1024, None), "o": ("none", 1024, 2048, None),
             "gate_up": ("add_rms_norm", 6144, 1024, None), "down": ("silu_and_mul", 1024, 3072, None),
             "lm_head": ("rms_norm", 151936, 1024, torch.float32)},
    "smollm2-135m": {"qkv": ("add_rms_norm", 960, 576, None), "o": ("none", 576, 576, None),
                     "gate_up": ("add_rms_norm", 3072, 576, None), "down": ("silu_and_mul", 576, 1536, None),
                     "lm_head": ("rms_norm", 49152, 576, torch.float32)},
    "tiny": {"qkv": ("add_rms_norm", 96, 64, None), "o": ("none", 64, 96, None),
             "down": ("silu_and_mul", 64, 80, None), "lm_head": ("rms_norm", 200, 64, torch.float32)},
}
# --sweep's candidates for the GEMV: (BLOCK_N, BLOCK_K, num_warps), each with split-K 1, 2, 4 and 8 (a
# split that leaves a program fewer than 2 K-tiles is dropped), tensor-core dots where the rule uses them
SWEEP_TILES = ((4, 256, 4), (4, 512, 4), (4, 1024, 8), (8, 128, 4), (8, 256, 4), (8, 512, 8), (8, 1024, 8),
               (16, 128, 4), (16, 256, 4), (16, 256, 8), (32, 128, 4), (32, 256, 8), (64, 128, 8))
SWEEP_SPLITS = (1, 2, 4, 8)
LAYER = ("qkv", "o", "gate_up", "down")  # the linears of one decoder layer
PROVIDERS = {
    "naive": "gemv_ref: the unfused ops in float32, rounded where the layers round",
    "unfused": "what the engine runs without small_batch_gemv: the prologue's op (torch.compile'd RMSNorm + add, "
               "the Triton SiLU-and-mul kernel) then the GEMM (F.linear / torch.mm: cuBLAS)",
    "cublas": "the GEMM alone (cuBLAS), on the prologue's output: the library's floor for the product",
    "ours": "gemv (Triton): the prologue folded in, split-K, one kernel",
}


def gemv_bytes(prologue, M, N, K, itemsize, out_itemsize):
    """Bytes the fused kernel must move: the weight once, its input rows once (two inputs for the
    add, 2K columns for SiLU-and-mul), the output once (and the residual sum for the add)."""
    inputs = {"add_rms_norm": 2 * M * K, "silu_and_mul": 2 * M * K}.get(prologue, M * K)
    written = M * N * out_itemsize + (M * K * itemsize if prologue == "add_rms_norm" else 0)
    return N * K * itemsize + inputs * itemsize + written


def make_inputs(prologue, M, N, K, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, 2 * K if prologue == "silu_and_mul" else K, generator=g, device=device).to(dtype)
    kwargs = dict(prologue=prologue, weight=(torch.randn(N, K, generator=g, device=device) / K**0.5).to(dtype))
    if prologue in ("rms_norm", "add_rms_norm"):
        kwargs.update(norm_weight=(torch.rand(K, generator=g, device=device) + 0.5).to(dtype), eps=1e-6)
    if prologue == "add_rms_norm":
        kwargs["residual"] = torch.randn(M, K, generator=g, device=device).to(dtype)
    return x, kwargs


def unfused_ops(on_cuda):
    """(the prologue's op on its own, the GEMM) as the engine's layers run them."""
    from minivllm.engine.fused_ops import compiled_add_rms_norm, compiled_rms_norm, silu_and_mul_kernel
    from minivllm.kernels.silu_and_mul import silu_and_mul_ref
    from minivllm.layers.embed_head import float32_logits
    from minivllm.layers.layernorm import add_rms_norm, rms_norm

    norm, add_norm = (compiled_rms_norm, compiled_add_rms_norm) if on_cuda else (rms_norm, add_rms_norm)
    silu = silu_and_mul_kernel if on_cuda else silu_and_mul_ref

    def prologue_op(x, kw):
        if kw["prologue"] == "add_rms_norm":
            return add_norm(x, kw["residual"], kw["norm_weight"], kw["eps"])[0]
        if kw["prologue"] == "rms_norm":
            return norm(x, kw["norm_weight"], kw["eps"])
        return silu(x) if kw["prologue"] == "silu_and_mul" else x

    def gemm(a, weight, out_dtype):
        return float32_logits(a, weight) if out_dtype == torch.float32 else F.linear(a, weight)

    return prologue_op, gemm


def providers(out_dtype, on_cuda):
    from minivllm.kernels.gemv import gemv, gemv_ref

    prologue_op, gemm = unfused_ops(on_cuda)
    P = common.Provider
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731 (the output, not the residual sum)
    return {
        "naive": P("naive", lambda s: s, lambda x, kw: gemv_ref(x, **kw, out_dtype=out_dtype), first),
        "unfused": P("unfused", lambda s: s, lambda x, kw: gemm(prologue_op(x, kw), kw["weight"], out_dtype)),
        "cublas": P("cublas", lambda s: (prologue_op(*s), s[1]["weight"]), lambda a, w: gemm(a, w, out_dtype)),
        "ours": P("ours", lambda s: s, lambda x, kw: gemv(x, **kw, out_dtype=out_dtype), first),
    }


def run_shape(model, layer, M, args, dtype, device, copy_tbps, on_cuda):
    from minivllm.kernels.gemv import gemv_config, gemv_ref

    prologue, N, K, out_dtype = MODEL_SHAPES[model][layer]
    num_bytes = gemv_bytes(prologue, M, N, K, dtype.itemsize, (out_dtype or dtype).itemsize)
    input_sets = [make_inputs(prologue, M, N, K, dtype, device, args.seed + i)
                  for i in range(common.num_input_sets(num_bytes, args.rotate_factor))]
    x, kw = input_sets[0]
    reference = gemv_ref(x.float(), **{k: v.float() if torch.is_tensor(v) else v for k, v in kw.items()})
    reference = reference[0] if isinstance(reference, tuple) else reference
    atol = 2e-2 * reference.abs().max().item()  # a half-precision output's rounding, and the prologue's
    config = gemv_config(M, N, K, dtype, x.device)
    rows = []
    for key, provider in providers(out_dtype, on_cuda).items():
        result = common.measure([provider], input_sets, reference, atol, args.warmup_ms, args.rep_ms,
                                args.cuda_graph and key != "naive", args.graph_calls)
        row = {"model": model, "layer": layer, "prologue": prologue, "case": f"{layer} M={M}", "M": M, "N": N,
               "K": K, "provider": key, "bytes": num_bytes, "floor_ms": num_bytes / (copy_tbps * 1e12) * 1e3,
               "num_input_sets": len(input_sets), **result.as_dict()}
        if key == "ours":
            row["config"] = config.__dict__
        if result.ms:
            row["fraction_of_copy"] = row["floor_ms"] / result.ms
        rows.append(row)
        print(f"  {row['case']:>14} {key:>8}: {row['status']:>11} {common.fmt(row.get('ms'))} ms "
              f"({common.fmt(row.get('fraction_of_copy'))} of copy) {row.get('error', '')[:120]}", flush=True)
    if args.sweep:
        rows.append(sweep(model, layer, M, config, input_sets, reference, atol, args, rows[-1]["floor_ms"]))
    ms = {r["provider"]: r.get("ms") for r in rows if r["status"] == "ok"}
    for r in rows:
        if r.get("ms") and ms.get("unfused"):
            r["vs_unfused"] = r["ms"] / ms["unfused"]
    return rows


def sweep(model, layer, M, rule, input_sets, reference, atol, args, floor_ms):
    """The GEMV at every tile x split config (--sweep-tiles, --sweep-splits; the rule's DOT choice, or both
    with --sweep-dot both): the fastest, as a provider row "best" (its config and every config's time
    kept), for gemv_config's rule to learn from."""
    from minivllm.kernels.gemv import GemvConfig, gemv

    prologue, N, K, out_dtype = MODEL_SHAPES[model][layer]
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    timings = []
    dots = (False, True) if args.sweep_dot == "both" else (rule.DOT,)
    for (block_n, block_k, warps), split, dot in itertools.product(args.sweep_tiles, args.sweep_splits, dots):
        if split > 1 and K // split < 2 * block_k or dot and block_n < 16:  # (a dot's tiles: 16 wide at least)
            continue
        config = GemvConfig(block_n, block_k, split, dot, warps)
        provider = common.Provider("ours", lambda s: s,
                                   lambda x, kw, c=config: gemv(x, **kw, out_dtype=out_dtype, config=c), first)
        result = common.measure([provider], input_sets, reference, atol, 10, args.sweep_rep_ms, args.cuda_graph,
                                args.graph_calls)
        if result.status == "ok":
            timings.append((result.ms, config.__dict__))
    timings.sort(key=lambda t: t[0])
    row = {"model": model, "layer": layer, "prologue": prologue, "case": f"{layer} M={M}", "M": M, "N": N, "K": K,
           "provider": "best", "floor_ms": floor_ms, "status": "ok" if timings else "unavailable",
           "configs_timed": len(timings), "sweep": [dict(ms=ms, **c) for ms, c in timings]}
    if timings:
        row.update(ms=timings[0][0], config=timings[0][1], fraction_of_copy=floor_ms / timings[0][0])
    print(f"  {row['case']:>14}     best: {common.fmt(row.get('ms'))} ms ({common.fmt(row.get('fraction_of_copy'))} "
          f"of copy) {row.get('config')}", flush=True)
    return row


def layer_rows(rows, batches):
    """One decoder layer's four linears added up, per M and provider (what 28 layers repeat)."""
    out = []
    for M in batches:
        for key in ("unfused", "cublas", "ours", "best"):
            parts = [r for r in rows if r["M"] == M and r["provider"] == key and r["layer"] in LAYER]
            layers = [name for name in LAYER if name in {r["layer"] for r in rows}]  # the tiny model has no gate_up
            if parts and len(parts) == len(layers) and all(r["status"] == "ok" for r in parts):
                out.append({"case": f"layer M={M}", "M": M, "provider": key, "ms": sum(r["ms"] for r in parts),
                            "floor_ms": sum(r["floor_ms"] for r in parts)})
    return out


def _tiles(text):
    try:
        tiles = tuple(tuple(int(n) for n in tile.split("x")) for tile in text.split(","))
    except ValueError:
        tiles = ()
    if not tiles or any(len(tile) != 3 for tile in tiles):
        raise argparse.ArgumentTypeError(f"tiles are BLOCK_NxBLOCK_Kxwarps, comma-separated; got {text!r}")
    return tiles


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="0.6b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--batches", default="1,2,4,8,16", help="M (tokens) list")
    parser.add_argument("--rotate-factor", type=float, default=4, help="input sets span this x L2")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="time replays of a CUDA graph, as the decode steps run (--no-cuda-graph: eager calls)")
    parser.add_argument("--graph-calls", type=int, default=28,
                        help="calls back to back in one graph, time per call (28: one per layer of Qwen3-0.6B, as a "
                             "step runs them; 1: one call per replay, which adds the replay's own launch to each)")
    parser.add_argument("--sweep", action="store_true", help="also time every SWEEP_TILES x SWEEP_SPLITS config "
                        "of the GEMV per case; the fastest is the provider 'best'")
    parser.add_argument("--sweep-rep-ms", type=int, default=20, help="timing per swept config")
    parser.add_argument("--sweep-tiles", type=_tiles, default=SWEEP_TILES,
                        help="BLOCK_NxBLOCK_Kxwarps list, e.g. 4x128x4,16x128x4 (default: SWEEP_TILES)")
    parser.add_argument("--sweep-splits", type=lambda text: tuple(int(n) for n in text.split(",")),
                        default=SWEEP_SPLITS, help="split-K list (default: 1,2,4,8)")
    parser.add_argument("--sweep-dot", choices=["rule", "both"], default="rule",
                        help="both: every tile with multiply-adds and with tl.dot (16 rows a tile; float32 at "
                             "full precision), not only the rule's choice for the M")
    return common.add_common_args(parser)


CPU_SMOKE = dict(model="tiny", batches="1,3", copy_bytes=16 * 2**20)


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {args.dtype}", flush=True)
    copy = common.measure_copy_bandwidth(args.copy_bytes or 2**30)
    print(f"  ceiling: copy {common.fmt(copy['TBps'])} TB/s", flush=True)
    rows = [row for layer in MODEL_SHAPES[args.model] for M in batches
            for row in run_shape(args.model, layer, M, args, dtype, device, copy["TBps"], on_cuda)]
    layers = layer_rows(rows, batches)
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args), "providers": PROVIDERS,
               "ceilings": {"copy": copy}, "byte_formula": gemv_bytes.__doc__, "results": rows, "layer": layers}
    common.write_json(args.out_dir, NAME, payload)
    plot(rows + layers, args, env)
    print_summary(rows + layers, batches)
    return payload


def plot(rows, args, env):
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = {p: [next((r["floor_ms"] / r["ms"] for r in rows if r["case"] == c and r["provider"] == p
                        and r.get("ms") and r.get("status", "ok") == "ok"), None) for c in cases]
              for p in ("unfused", "cublas", "ours", "best") if any(r["provider"] == p for r in rows)}
    panel = {"title": f"Qwen3-{args.model} linears at small M: fraction of the copy-bandwidth floor (higher is better)",
             "categories": cases, "series": series, "ylabel": "floor / time", "hline": ("floor", 1.0)}
    common.plot_panels(args.out_dir / f"{NAME}.png", [panel],
                       f"{env['device']} | {args.dtype} | torch {env['torch']} triton {env['triton']} | {env['date_utc']}")


def print_summary(rows, batches):
    table = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["provider"]: r for r in rows if r["case"] == case}
        cells = [common.fmt(by[p]["ms"] * 1e3) if p in by and by[p].get("ms") else "-"
                 for p in ("unfused", "cublas", "ours", "best")]
        ours, unfused = by.get("ours", {}), by.get("unfused", {})
        ratio = ours["ms"] / unfused["ms"] if ours.get("ms") and unfused.get("ms") else None
        table.append([case, common.fmt(next(iter(by.values()))["floor_ms"] * 1e3), *cells, common.fmt(ratio)])
    common.print_table(["case", "floor us", "unfused us", "cublas us", "ours us", "best us (--sweep)",
                        "ours / unfused"], table,
                       title="Small-batch linears, median us per call (every provider checked against gemv_ref "
                             "in float32 first; floor: bytes at the measured copy bandwidth)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
