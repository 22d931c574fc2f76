"""Is the paged decode kernel bound by HBM or by its own work? Time it over a cache in HBM and over one
that fits in L2, for a bf16 and an FP8 cache.

The L2 case keeps every shape's work (same batch, context, block table width, tiles, dots, softmax,
conversions) but points every block-table entry into the first 512 blocks, so the K/V bytes come from
L2 (bf16: 32 MiB, FP8: 16 MiB for 8 KV heads of 128, blocks of 16) instead of HBM. If a kernel's time
barely falls when its bytes come from L2, HBM is not what bounds it: its per-tile work is, and a
smaller cache cannot make it faster. CUDA-graph replays, as the engine's decode steps run.

    python -m benchmarks.probe_decode_bound [--shapes 8x32768,64x4096,256x4096] [--out-dir DIR]
    python -m benchmarks.probe_decode_bound --tiny     # CPU (Triton interpreter), seconds
    python -m benchmarks.probe_decode_bound --shapes 64x4096 --ncu   # and what each cache's call waits on

--ncu (Nsight Compute on PATH): one call per cache over the HBM case under ncu (benchmarks/ncu_stalls.py),
the warp-stall reasons of both caches side by side and the SASS lines where the FP8 call stalls most.
"""
import argparse
import subprocess
import sys

import torch

from benchmarks import common, ncu_stalls

NAME = "probe_decode_bound"
L2_BLOCKS = 512  # the blocks every table entry points into in the L2 case


def parse_shapes(text):
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def make_case(batch, context, where, args, dtype, device):
    """q, the caches (bf16 and FP8 codes of the same values), seqlens and the block table."""
    from minivllm.kernels.quant_fp8 import quantize_fp8_ref

    per_seq = context // args.block_size
    blocks = batch * per_seq if where == "hbm" else min(L2_BLOCKS, batch * per_seq)
    table = (torch.arange(batch * per_seq, device=device, dtype=torch.int32) % blocks).view(batch, per_seq)
    shape = (blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k, v = torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)
    one = torch.ones(1, device=device)
    q = torch.randn(batch, 1, args.num_heads, args.head_dim, device=device, dtype=dtype)
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    return {"q": q, "lens": lens, "table": table, "auto": (k, v, {}),
            "fp8": (quantize_fp8_ref(k, one), quantize_fp8_ref(v, one), dict(k_descale=one, v_descale=one))}


def decode_call(case, cache):
    """The decode kernel's call over this case's cache ("auto" or "fp8"), as a function of no argument."""
    from minivllm.kernels import flash_attn_with_kvcache

    k_cache, v_cache, scales = case[cache]

    def decode():
        return flash_attn_with_kvcache(case["q"], k_cache, v_cache, cache_seqlens=case["lens"],
                                       block_table=case["table"], **scales)

    return decode


def time_case(case, cache, args):
    decode = decode_call(case, cache)
    out = decode().float()
    return common.bench_ms(decode, [()], args.warmup_ms, args.rep_ms, cuda_graph=True), out


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x32768,64x4096,256x4096", help="batch x context list")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ncu", action="store_true", help="also profile one call per cache under Nsight Compute")
    parser.add_argument("--ncu-child", choices=("auto", "fp8"), help=argparse.SUPPRESS)  # the process ncu profiles
    return common.add_common_args(parser)


def run_child(args, dtype, device):
    """Three calls over the first shape's HBM case: ncu skips two (compilation, warm-up), profiles one."""
    batch, context = parse_shapes(args.shapes)[0]
    decode = decode_call(make_case(batch, context, "hbm", args, dtype, device), args.ncu_child)
    for _ in range(3):
        decode()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"child": args.ncu_child, "shape": f"{batch}x{context}"}


def ncu_rows(args):
    """Each shape, each cache: ncu_stalls.profile of a child process; prints the stall table."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        reports = {}
        for cache in ("auto", "fp8"):
            child = [sys.executable, "-m", "benchmarks.probe_decode_bound", "--ncu-child", cache, "--shapes", shape,
                     "--dtype", args.dtype, "--block-size", str(args.block_size), "--num-heads", str(args.num_heads),
                     "--num-kv-heads", str(args.num_kv_heads), "--head-dim", str(args.head_dim)]
            try:
                base = args.out_dir / f"{NAME}_ncu_{shape}_{cache}"
                reports[cache] = ncu_stalls.profile(child, "paged_decode_kernel", base)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  ncu {shape} {cache}: {e}", flush=True)
        rows.append({"shape": shape, **reports})
        reasons = list(dict.fromkeys(r for rep in reports.values() for r in list(rep["stalls"])[:8]))
        common.print_table(["stall reason", *(f"{args.dtype if c == 'auto' else c} cache" for c in reports)],
                           [(r, *(common.fmt(rep["stalls"].get(r)) for rep in reports.values())) for r in reasons],
                           title=f"{shape}: warps stalled per issued instruction, by reason (ncu)")
        for cache, rep in reports.items():
            print(f"  {shape} {cache}: " + ", ".join(f"{k} {common.fmt(v) if isinstance(v, float) else v}"
                                                     for k, v in rep["metrics"].items()
                                                     if not k.startswith(ncu_stalls.STALL_PREFIX)))
        if "fp8" in reports:
            print(f"  {shape} fp8: the SASS lines with the most stall samples")
            for address, line, samples, share in reports["fp8"]["top_lines"]:
                print(f"    {address} {share:6.1%}  {line}")
    return rows


TINY = dict(shapes="2x64", num_heads=4, num_kv_heads=2, head_dim=32)


def main(argv=None):
    run = common.start_run(build_parser(), argv, TINY)
    args, dtype, device, env = run.args, run.dtype, run.device, run.env
    if args.ncu_child:
        return run_child(args, dtype, device)
    if args.ncu and not ncu_stalls.available():
        raise SystemExit("--ncu needs Nsight Compute's ncu on PATH")
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env.get('triton')}, {args.dtype}", flush=True)
    rows = []
    for batch, context in parse_shapes(args.shapes):
        times, errors = {}, {}
        for where in ("hbm", "l2"):
            case = make_case(batch, context, where, args, dtype, device)
            (times["auto", where], out), (times["fp8", where], out_fp8) = (
                time_case(case, "auto", args), time_case(case, "fp8", args))
            # the same values through both caches: the FP8 path's output within e4m3's rounding of bf16's
            errors[where] = (out_fp8 - out).abs().max().item()
            del case
        for cache in ("auto", "fp8"):
            itemsize = 1 if cache == "fp8" else torch.finfo(dtype).bits // 8
            gb = 2 * batch * context * args.num_kv_heads * args.head_dim * itemsize / 1e9
            hbm, l2 = times[cache, "hbm"], times[cache, "l2"]
            rows.append({"shape": f"{batch}x{context}", "cache": "fp8" if cache == "fp8" else args.dtype,
                         "GB_read": gb, "hbm_ms": hbm, "l2_ms": l2, "hbm_TBps": gb / hbm,
                         "l2_over_hbm": l2 / hbm, "max_abs_diff_fp8_vs_unquantized": errors})
            print(f"  {batch}x{context} {rows[-1]['cache']}: HBM {hbm:.4f} ms, L2 {l2:.4f} ms", flush=True)
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args), "rows": rows,
               "l2_blocks": L2_BLOCKS, "ncu": ncu_rows(args) if args.ncu else None}
    common.write_json(args.out_dir, NAME, payload)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series = {f"{cache} cache, {where}": [next(r[f"{where}_ms"] for r in rows if r["shape"] == s and r["cache"] == cache)
                                          for s in shapes]
              for cache in dict.fromkeys(r["cache"] for r in rows) for where in ("hbm", "l2")}
    common.plot_panels(args.out_dir / f"{NAME}.png", [{
        "title": "paged decode, CUDA-graph replay: cache in HBM vs a cache that fits in L2 (same work)",
        "categories": shapes, "series": series, "ylabel": "ms"}],
        f"{env['device']} | torch {env['torch']} | {env['date_utc']}")
    common.print_table(["shape", "cache", "GB read", "HBM ms", "HBM TB/s", "L2 ms", "L2 / HBM time"],
                       [(r["shape"], r["cache"], f"{r['GB_read']:.3g}", f"{r['hbm_ms']:.4f}",
                         common.fmt(r["hbm_TBps"]), f"{r['l2_ms']:.4f}", f"{r['l2_over_hbm']:.2f}") for r in rows],
                       title="Decode over a cache in HBM and in L2 (near 1: bound by the kernel's own work, not HBM)")
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
