"""FP8 GEMMs of the linear layers, paired: the dequantize-then-matmul reference, our Triton
block-scaled FP8 kernel (with and without the activation quantization the layer runs before it),
torch._scaled_mm with per-token x per-channel scales (cuBLASLt), and the bf16 torch.matmul that
FP8 replaces, at the Qwen3-0.6B and Qwen3-8B linear shapes for decode and prefill batch sizes.
vLLM: benchmarks/kernels/benchmark_w8a8_block_fp8.py and bench_fp8_gemm.py.

    python -m benchmarks.bench_fp8_gemm [--models 0.6b,8b] [--batches 1,16,64,128,256,2048] [--cpu-smoke]
"""
import argparse
import sys
from dataclasses import dataclass

import torch

from benchmarks import common

NAME = "bench_fp8_gemm"
# [N, K] of each linear layer (tensor_parallel_size 1): qkv, o, gate_up, down
MODEL_SHAPES = {
    "0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "tiny": {"qkv": (256, 256), "down": (128, 384)},  # --cpu-smoke
}
BLOCK_SIZE = (128, 128)
PROVIDERS = {
    "naive": "w8a8_block_fp8_matmul_ref: dequantize a and b to float32, matmul, round (block-FP8 scales)",
    "ours": "w8a8_block_fp8_matmul (Triton): fp8 x fp8 tensor-core dots, 128 x 128 weight-block and "
            "1 x 128 activation-group scales applied per K tile",
    "ours+quant": "per_token_group_quant_fp8 (Triton) then w8a8_block_fp8_matmul: what a block-FP8 layer runs",
    "scaled_mm": "torch._scaled_mm, per-token x per-output-channel scales (cuBLASLt row-wise scaling)",
    "scaled_mm+quant": "per-token quantization (Triton) then torch._scaled_mm: what quantization='fp8' runs",
    "bf16": "torch.matmul(x, w.t()) in bfloat16: the unquantized layer",
    "note": "every provider is checked against its own reference (the block or per-channel dequantized "
            "product, or the float32 product for bf16) before it is timed",
}


def gemm_flops(M, N, K):
    """2 FLOPs (a multiply and an add) per multiply-accumulate: 2 * M * N * K."""
    return 2 * M * N * K


def gemm_bytes(M, N, K, weight_itemsize, act_itemsize, out_itemsize=2):
    """Bytes a GEMM must move at least: the weight once, the activations once, the output once
    (scales are < 1 % at 128 x 128 blocks and left out). Decode is bound by the weight term."""
    return N * K * weight_itemsize + M * K * act_itemsize + M * N * out_itemsize


@dataclass
class GemmInputs:
    x: torch.Tensor  # [M, K] activations in the model dtype
    w: torch.Tensor  # [N, K] weight in the model dtype
    a: torch.Tensor  # block path: x's codes [M, K] and per-token-group scales [M, K/128]
    a_scale: torch.Tensor
    b: torch.Tensor  # block path: w's codes [N, K] and block scales [N/128, K/128]
    b_scale: torch.Tensor
    a1: torch.Tensor  # per-channel path: x's codes and per-token scales [M, 1]
    a1_scale: torch.Tensor
    b1: torch.Tensor  # per-channel path: w's codes and per-channel scales [N, 1]
    b1_scale: torch.Tensor


def make_inputs(M, N, K, dtype, device, seed):
    from minivllm.kernels import per_token_group_quant_fp8_ref, quantize_fp8_blocks_ref

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device).to(dtype)
    w = (torch.randn(N, K, generator=g, device=device) * 0.02).to(dtype)
    a, a_scale = per_token_group_quant_fp8_ref(x, BLOCK_SIZE[1])
    b, b_scale = quantize_fp8_blocks_ref(w, *BLOCK_SIZE)
    a1, a1_scale = per_token_group_quant_fp8_ref(x, K)
    b1, b1_scale = quantize_fp8_blocks_ref(w, 1, K)
    return GemmInputs(x, w, a, a_scale, b, b_scale, a1, a1_scale, b1, b1_scale)


def providers(dtype):
    """{name: [Provider]} and which reference each is checked against."""
    from minivllm.kernels import (
        per_token_group_quant_fp8, scaled_mm_per_channel, w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref,
    )

    def ours(a, a_scale, b, b_scale):
        return w8a8_block_fp8_matmul(a, a_scale, b, b_scale, BLOCK_SIZE, dtype)

    def ours_quant(x, b, b_scale):
        a, a_scale = per_token_group_quant_fp8(x, BLOCK_SIZE[1])
        return w8a8_block_fp8_matmul(a, a_scale, b, b_scale, BLOCK_SIZE, dtype)

    def scaled_mm_quant(x, b1, b1_scale):
        a1, a1_scale = per_token_group_quant_fp8(x, x.shape[1])
        return scaled_mm_per_channel(a1, a1_scale, b1, b1_scale, dtype)

    P = common.Provider
    return {
        "naive": ("block", [P("naive", lambda s: (s.a, s.a_scale, s.b, s.b_scale),
                              lambda *t: w8a8_block_fp8_matmul_ref(*t, BLOCK_SIZE, dtype))]),
        "ours": ("block", [P("ours", lambda s: (s.a, s.a_scale, s.b, s.b_scale), ours)]),
        "ours+quant": ("block", [P("ours+quant", lambda s: (s.x, s.b, s.b_scale), ours_quant)]),
        "scaled_mm": ("channel", [P("scaled_mm", lambda s: (s.a1, s.a1_scale, s.b1, s.b1_scale),
                                    lambda *t: scaled_mm_per_channel(*t, dtype))]),
        "scaled_mm+quant": ("channel", [P("scaled_mm+quant", lambda s: (s.x, s.b1, s.b1_scale), scaled_mm_quant)]),
        "bf16": ("unquantized", [P("bf16", lambda s: (s.x, s.w.t()), torch.matmul)]),
    }


def references(x):
    from minivllm.kernels import w8a8_block_fp8_matmul_ref

    K = x.x.shape[1]
    return {"block": w8a8_block_fp8_matmul_ref(x.a, x.a_scale, x.b, x.b_scale, BLOCK_SIZE, torch.float32),
            "channel": w8a8_block_fp8_matmul_ref(x.a1, x.a1_scale, x.b1, x.b1_scale, (1, K), torch.float32),
            "unquantized": x.x.float() @ x.w.float().t()}


def run_shape(model, layer, M, args, dtype, device, copy_tbps):
    N, K = MODEL_SHAPES[model][layer]
    num_sets = common.num_input_sets(N * K * 4 + M * K * 4, args.rotate_factor)  # bf16 + fp8 copies of both
    input_sets = [make_inputs(M, N, K, dtype, device, args.seed + i) for i in range(num_sets)]
    refs = references(input_sets[0])
    rows = []
    for key, (ref_name, variants) in providers(dtype).items():
        if key == "naive" and M * N * K > args.naive_max_macs:
            continue
        ref = refs[ref_name]
        # the output dtype's rounding (bf16: 2^-9 relative) and a different summation order
        atol = 1e-2 * ref.abs().max().item()
        result = common.measure(variants, input_sets, ref, atol, args.warmup_ms, args.rep_ms, args.cuda_graph)
        quantized = key != "bf16"
        row = {"model": model, "layer": layer, "case": f"{model} {layer} M={M}", "M": M, "N": N, "K": K,
               "provider": key, "flops": gemm_flops(M, N, K),
               "bytes": gemm_bytes(M, N, K, 1 if quantized else 2, 1 if key in ("ours", "scaled_mm") else 2),
               "num_input_sets": num_sets, **result.as_dict()}
        row["provider"] = key
        if result.ms:
            row["TFLOPs"] = row["flops"] / (result.ms * 1e-3) / 1e12
            row["TBps"] = row["bytes"] / (result.ms * 1e-3) / 1e12
            row["fraction_of_copy"] = row["TBps"] / copy_tbps
        rows.append(row)
        print(f"  {row['case']:>22} {key:>15}: {row['status']:>11} {common.fmt(row.get('ms'))} ms "
              f"{common.fmt(row.get('TFLOPs'))} TFLOP/s {common.fmt(row.get('TBps'))} TB/s {row.get('error', '')[:120]}",
              flush=True)
    _add_ratios(rows)
    return rows


def _add_ratios(rows):
    """vs_scaled_mm = our ms / torch._scaled_mm ms (<= 1.2 is the target), the same for the versions
    that quantize the activations; speedup_over_bf16 = bf16 ms / this provider's ms."""
    ms = {r["provider"]: r.get("ms") for r in rows if r["status"] == "ok"}
    for r in rows:
        if not r.get("ms"):
            continue
        if ms.get("bf16"):
            r["speedup_over_bf16"] = ms["bf16"] / r["ms"]
        peer = {"ours": "scaled_mm", "ours+quant": "scaled_mm+quant"}.get(r["provider"])
        if peer and ms.get(peer):
            r["vs_scaled_mm"] = r["ms"] / ms[peer]


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.6b,8b", help=f"comma list of {sorted(MODEL_SHAPES)}")
    parser.add_argument("--batches", default="1,16,64,128,256,2048", help="M (tokens) list: decode and prefill")
    parser.add_argument("--naive-max-macs", type=float, default=2e11,
                        help="skip the float32 reference above this many multiply-adds (it is slow)")
    parser.add_argument("--rotate-factor", type=float, default=4, help="input sets span this x L2")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="time replays of a CUDA graph, as the engine's decode steps run the layers "
                             "(--no-cuda-graph: eager calls, which time the host's launch cost of small GEMMs)")
    common.add_common_args(parser)
    parser.set_defaults(dtype="bfloat16")  # the FP8 GEMMs' output dtype (row-wise _scaled_mm needs bf16)
    return parser


CPU_SMOKE = dict(models="tiny", batches="1,7,33", copy_bytes=16 * 2**20)


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    models = list(filter(None, args.models.split(",")))
    unknown = [m for m in models if m not in MODEL_SHAPES]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {sorted(MODEL_SHAPES)}")
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env['triton']}, output {args.dtype}", flush=True)
    copy = common.measure_copy_bandwidth(args.copy_bytes or 2**30)
    matmul = common.measure_matmul_rate(512 if args.cpu_smoke else 8192, dtype)
    print(f"  ceilings: copy {common.fmt(copy['TBps'])} TB/s, bf16 matmul {common.fmt(matmul['TFLOPs'])} TFLOP/s",
          flush=True)
    rows = []
    for model in models:
        for layer in MODEL_SHAPES[model]:
            for M in map(int, filter(None, args.batches.split(","))):
                rows += run_shape(model, layer, M, args, dtype, device, copy["TBps"])
                if on_cuda:
                    torch.cuda.empty_cache()
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args), "providers": PROVIDERS,
               "ceilings": {"copy": copy, "matmul": matmul}, "flop_formula": gemm_flops.__doc__,
               "byte_formula": gemm_bytes.__doc__, "results": rows}
    common.write_json(args.out_dir, NAME, payload)
    plot(rows, args, env)
    print_summary(rows, args.cuda_graph and on_cuda)
    return payload


def plot(rows, args, env):
    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        cases = list(dict.fromkeys(f"{r['layer']} M={r['M']}" for r in sub))
        names = [p for p in dict.fromkeys(r["provider"] for r in sub) if p not in ("naive", "bf16")]
        series = {p: [next((r.get("speedup_over_bf16") for r in sub if r["provider"] == p and r["status"] == "ok"
                            and f"{r['layer']} M={r['M']}" == c), None) for c in cases] for p in names}
        panels.append({"title": f"Qwen3-{model} linear layers: speedup over bf16 torch.matmul (higher is better)",
                       "categories": cases, "series": series, "ylabel": "x bf16", "hline": ("bf16", 1.0)})
    common.plot_panels(args.out_dir / f"{NAME}.png", panels,
                       f"{env['device']} | output {args.dtype} | torch {env['torch']} triton {env['triton']} | "
                       f"{env['date_utc']}")


def print_summary(rows, graphed=False):
    """One line per shape: each provider's ms (FAIL / n/a where it did not pass), then the ratios."""
    names = list(PROVIDERS)[:-1]  # every provider, in PROVIDERS' order ("note" is not one)
    table = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["provider"]: r for r in rows if r["case"] == case}
        cells = [common.fmt(by[p]["ms"]) if p in by and by[p]["status"] == "ok" else
                 (by[p]["status"] if p in by else "-") for p in names]
        ours = by.get("ours", {})
        table.append([case, *cells, common.fmt(ours.get("vs_scaled_mm")), common.fmt(ours.get("speedup_over_bf16")),
                      common.fmt(by.get("scaled_mm", {}).get("speedup_over_bf16"))])
    common.print_table(["case", *[f"{p} ms" for p in names], "ours / scaled_mm", "ours x bf16", "scaled_mm x bf16"],
                       table, title="FP8 GEMMs, median ms " + ("per call in CUDA graph replays " if graphed else "eager ")
                       + "(FLOPs = 2*M*N*K; every provider checked against its reference first; the JSON has "
                         "TFLOP/s, TB/s and errors)")
    ratios = [r["vs_scaled_mm"] for r in rows if r["provider"] == "ours" and r.get("vs_scaled_mm")]
    if ratios:
        worst = max(rows, key=lambda r: r.get("vs_scaled_mm", 0) if r["provider"] == "ours" else 0)
        print(f"\nours (Triton block-FP8) / torch._scaled_mm (per-channel), ms ratio over {len(ratios)} shapes: "
              f"median {sorted(ratios)[len(ratios) // 2]:.2f}, worst {worst['vs_scaled_mm']:.2f} ({worst['case']}); "
              f"target <= 1.2")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
