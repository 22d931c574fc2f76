"""The fused MoE layer at Qwen3-30B-A3B's expert shapes (E=128, top-8, K=2048, N=768, bf16), paired:
our Triton `fused_moe`, the naive per-expert loop `fused_moe_ref`, and torch's grouped GEMM
(`torch._grouped_mm`, where this torch has it) on the same tokens, beside a bf16 torch.matmul and a
device copy measured in the same run, and vLLM 0.25.1's fused_experts times on an H200 (recorded
anchor figures, cited below). vLLM: benchmarks/kernels/benchmark_moe.py.

    PYTHONPATH=. python -m benchmarks.bench_moe [--out DIR] [--quick] [--batches 1,16,256] [--cpu-smoke]
"""
import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import common

NAME = "bench_moe"
QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)  # per expert
TINY = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)  # --cpu-smoke
DEFAULT_BATCHES = "1,4,16,64,256,1024,4096,16384"
QUICK_BATCHES = "1,16,256,4096"
# vLLM 0.25.1 fused_experts, H200, 2026-12-01: ms per call by M at QWEN3_30B_A3B in bf16, a recorded
# anchor (not measured in this run or by this script): an anchor to compare against, not a ceiling.
VLLM_FUSED_EXPERTS_MS = {1: 0.030, 4: 0.082, 16: 0.200, 64: 0.294, 256: 0.323, 1024: 0.382, 4096: 0.804,
                         16384: 2.90}
VLLM_ANCHOR = "vLLM 0.25.1 fused_experts, H200, 2026-12-01"
OTHER_PATH_MAX_M = 64  # ours_other_path runs up to this many tokens
PROVIDERS = {
    "ours": "minivllm.kernels.fused_moe.fused_moe (Triton) as moe_config chooses: up to SMALL_MAX_PAIRS "
            "(token, slot) pairs the few-pairs path (gate_up per pair, down per token with the sum over "
            "top-k fused, no align); above it align (counting sort), gate_up GEMM with SiLU-and-mul in its "
            "epilogue, down GEMM times the routing weight, torch sum over top-k; timed as CUDA-graph replays",
    "ours_other_path": "fused_moe forced down the path moe_config does not choose, where both are "
                       f"plausible (M <= {OTHER_PATH_MAX_M} tokens): the aligned GEMMs with 16-row tiles, or the few-pairs "
                       "path; where the crossover lies",
    "naive": "fused_moe_ref: a loop over the experts, float32 matmuls; syncs per expert (nonzero), so timed "
             "eagerly, and only up to --naive-max-m tokens",
    "torch_grouped_mm": "torch._grouped_mm (CUTLASS grouped GEMM, sm90, torch >= 2.8) on tokens sorted by "
                        "expert with torch ops, F.silu * up between the two GEMMs; CUDA-graph replays",
    "note": "every provider is checked against fused_moe_ref on the first input set before it is timed; "
            f"vllm_over_ours = {VLLM_ANCHOR} ms / our ms (above 1: ours takes less time)",
}


def moe_flops(num_tokens, top_k, hidden_size, intermediate_size):
    """2 FLOPs per multiply-add; each (token, slot) pair runs gate_up (2N x K) and down (K x N):
    2 * M * topk * (2N*K + K*N). Padding rows of the tiles are not counted."""
    N, K = intermediate_size, hidden_size
    return 2 * num_tokens * top_k * (2 * N * K + K * N)


def active_expert_bytes(topk_ids, hidden_size, intermediate_size, itemsize):
    """Weight bytes of the distinct experts the routing hits, each read once:
    num_distinct(topk_ids) * (2N*K + K*N) * itemsize. The decode bound (activations are < 1 %)."""
    num_active = torch.unique(topk_ids).numel()
    return num_active * 3 * intermediate_size * hidden_size * itemsize


@dataclass
class MoEInputs:
    hidden_states: torch.Tensor  # [M, K]
    w13: torch.Tensor  # [E, 2N, K], shared by every input set
    w2: torch.Tensor  # [E, K, N], shared by every input set
    topk_weights: torch.Tensor  # [M, topk] float32
    topk_ids: torch.Tensor  # [M, topk] int32

    def args(self):
        return self.hidden_states, self.w13, self.w2, self.topk_weights, self.topk_ids


def make_weights(shape, dtype, device, seed):
    """w13, w2 ~ N(0, 1) / sqrt(fan-in): every stage of the MLP stays O(1)."""
    E, K, N = shape["num_experts"], shape["hidden_size"], shape["intermediate_size"]
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(E, 2 * N, K, generator=g, device=device) * K**-0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g, device=device) * N**-0.5).to(dtype)
    return w13, w2


def make_inputs(num_tokens, shape, weights, dtype, device, seed):
    """The router of a Qwen3-MoE layer on N(0, 1) logits: softmax, top-k, renormalised."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, shape["hidden_size"], generator=g, device=device).to(dtype)
    logits = torch.randn(num_tokens, shape["num_experts"], generator=g, device=device)
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(shape["top_k"], dim=-1)
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return MoEInputs(x, *weights, topk_weights.contiguous(), topk_ids.to(torch.int32).contiguous())


# ----------------------------------------------------------------------------- providers

def grouped_mm_moe(hidden_states, w13_t, w2_t, topk_weights, topk_ids):
    """The MoE layer through torch._grouped_mm, with no host sync: pairs sorted by expert (argsort),
    per-expert row counts by scatter_add (bincount would sync), two grouped GEMMs, unsort, sum.
    w13_t [E, K, 2N] and w2_t [E, N, K]: the weights as the GEMM's B operands."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13_t.shape[0]
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)  # pair ids by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # each expert's end row
    gate_up = torch._grouped_mm(hidden_states[order // top_k], w13_t, offs=offs)  # [M * topk, 2N]
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2_t, offs=offs)  # [M * topk, K]
    pair_out = torch.empty_like(down)
    pair_out[order] = (down.float() * topk_weights.flatten()[order, None]).to(down.dtype)
    return pair_out.view(num_tokens, top_k, -1).sum(dim=1)


def other_path_config(num_tokens, num_experts, intermediate_size, hidden_size, top_k, dtype):
    """The config of the path moe_config does not choose at this M (None above OTHER_PATH_MAX_M): the
    few-pairs path's tiles, or the aligned tiles moe_config gives the fewest pairs above its limit."""
    from minivllm.kernels.fused_moe import SMALL_CONFIG, SMALL_MAX_PAIRS, SmallMoEConfig, moe_config

    if num_tokens > OTHER_PATH_MAX_M:
        return None
    chosen = moe_config(num_tokens, num_experts, intermediate_size, hidden_size, top_k, dtype)
    if isinstance(chosen, SmallMoEConfig):
        return moe_config(SMALL_MAX_PAIRS // top_k + 1, num_experts, intermediate_size, hidden_size, top_k, dtype)
    return SMALL_CONFIG


def fused_moe_other_path(hidden_states, w13, w2, topk_weights, topk_ids):
    from minivllm.kernels.fused_moe import fused_moe

    config = other_path_config(hidden_states.shape[0], w13.shape[0], w2.shape[2], w2.shape[1], topk_ids.shape[1],
                               hidden_states.dtype)
    return fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, config=config)


def providers():
    """{name: ([Provider variants], cuda_graph)}."""
    from minivllm.kernels.fused_moe import fused_moe, fused_moe_ref

    P = common.Provider
    found = {
        "ours": ([P("ours", MoEInputs.args, fused_moe)], True),
        "ours_other_path": ([P("ours_other_path", MoEInputs.args, fused_moe_other_path)], True),
        "naive": ([P("naive", MoEInputs.args, fused_moe_ref)], False),
    }
    if hasattr(torch, "_grouped_mm"):  # torch >= 2.8; CUDA sm90 kernels only
        def transposed(s):  # B operands as views: column-major [E, K, 2N], [E, N, K]
            return s.hidden_states, s.w13.transpose(1, 2), s.w2.transpose(1, 2), s.topk_weights, s.topk_ids

        def copied(s):  # the same, row-major copies (untimed), for builds that want them
            return (s.hidden_states, s.w13.transpose(1, 2).contiguous(), s.w2.transpose(1, 2).contiguous(),
                    s.topk_weights, s.topk_ids)

        found["torch_grouped_mm"] = ([P("torch_grouped_mm", transposed, grouped_mm_moe, label="transposed views"),
                                      P("torch_grouped_mm", copied, grouped_mm_moe, label="row-major copies")],
                                     True)
    return found


# ----------------------------------------------------------------------------- run

def run_batch(num_tokens, shape, weights, args, dtype, device, ceilings):
    from minivllm.kernels.fused_moe import fused_moe_ref

    K, N, top_k = shape["hidden_size"], shape["intermediate_size"], shape["top_k"]
    input_sets = [make_inputs(num_tokens, shape, weights, dtype, device, args.seed + 1 + i) for i in range(2)]
    reference = fused_moe_ref(*input_sets[0].args())
    # bf16 rounding of the activation and of each slot's output, relative to the output's size
    atol = common.ATOL[dtype] * max(1.0, reference.abs().max().item())
    flops = moe_flops(num_tokens, top_k, K, N)
    weight_bytes = active_expert_bytes(input_sets[0].topk_ids, K, N, dtype.itemsize)
    vllm_ms = VLLM_FUSED_EXPERTS_MS.get(num_tokens) if shape == QWEN3_30B_A3B and dtype == torch.bfloat16 else None
    rows = []
    for name, (variants, cuda_graph) in providers().items():
        row = {"M": num_tokens, "provider": name, "flops": flops, "active_weight_bytes": weight_bytes}
        if name == "naive" and num_tokens > args.naive_max_m:
            rows.append({**row, "status": "skipped", "error": f"M > --naive-max-m {args.naive_max_m}"})
            continue
        if name == "ours_other_path" and num_tokens > OTHER_PATH_MAX_M:
            rows.append({**row, "status": "skipped", "error": f"M > {OTHER_PATH_MAX_M}: only the aligned path fits"})
            continue
        result = common.measure(variants, input_sets, reference, atol, args.warmup_ms, args.rep_ms, cuda_graph)
        row.update(result.as_dict(), provider=name, timing="CUDA graph" if cuda_graph and device == "cuda" else "eager")
        if result.ms:
            seconds = result.ms * 1e-3
            row["TFLOPs"] = flops / seconds / 1e12
            row["fraction_of_matmul"] = row["TFLOPs"] / ceilings["matmul"]["TFLOPs"]
            row["weight_TBps"] = weight_bytes / seconds / 1e12
            row["fraction_of_copy"] = row["weight_TBps"] / ceilings["copy"]["TBps"]
            if vllm_ms:
                row["vllm_ms"], row["vllm_over_ours"] = vllm_ms, vllm_ms / result.ms
        rows.append(row)
        print(f"  M={num_tokens:>6} {name:>16}: {row['status']:>11} {common.fmt(row.get('ms'))} ms "
              f"{common.fmt(row.get('TFLOPs'))} TFLOP/s {common.fmt(row.get('weight_TBps'))} TB/s "
              f"{row.get('variant', '')} {row.get('error', '')[:120]}", flush=True)
    ours = next((r for r in rows if r["provider"] == "ours" and r.get("ms")), None)
    for r in rows:  # ours_speedup = this provider's ms / our ms
        if ours and r.get("ms"):
            r["ours_speedup"] = r["ms"] / ours["ms"]
    return rows


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help="M (tokens) list")
    parser.add_argument("--quick", action="store_true", help=f"M in {QUICK_BATCHES} only, shorter timing")
    parser.add_argument("--naive-max-m", type=int, default=1024,
                        help="skip the per-expert reference loop above this many tokens (it is slow)")
    common.add_common_args(parser)
    parser.add_argument("--out", dest="out_dir", type=Path, help="the same as --out-dir")  # after: its default
    return parser


CPU_SMOKE = dict(batches="1,7,33", copy_bytes=16 * 2**20)


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    if not on_cuda and not args.cpu_smoke:
        raise SystemExit(f"{NAME} needs a CUDA GPU (Qwen3-30B-A3B's experts are 1.2 GB of bf16 weights); "
                         "--cpu-smoke runs tiny shapes in the Triton interpreter instead")
    if args.quick:
        args.batches = QUICK_BATCHES if args.batches == DEFAULT_BATCHES else args.batches
        args.rep_ms = min(args.rep_ms, 50)
    shape = TINY if args.cpu_smoke else QWEN3_30B_A3B
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {args.dtype}, {shape}", flush=True)
    copy = common.measure_copy_bandwidth(args.copy_bytes or 2**30)
    matmul = common.measure_matmul_rate(256 if args.cpu_smoke else 8192, dtype)
    ceilings = {"copy": copy, "matmul": matmul}
    print(f"  ceilings: copy {common.fmt(copy['TBps'])} TB/s, {args.dtype} matmul {matmul['n']}^3 "
          f"{common.fmt(matmul['TFLOPs'])} TFLOP/s", flush=True)
    weights = make_weights(shape, dtype, device, args.seed)
    rows = []
    for num_tokens in map(int, filter(None, args.batches.split(","))):
        rows += run_batch(num_tokens, shape, weights, args, dtype, device, ceilings)
        if on_cuda:
            torch.cuda.empty_cache()
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args), "shape": shape,
               "providers": PROVIDERS, "ceilings": ceilings,
               "anchor": {"source": VLLM_ANCHOR, "ms_by_M": VLLM_FUSED_EXPERTS_MS},
               "flop_formula": moe_flops.__doc__, "byte_formula": active_expert_bytes.__doc__, "results": rows}
    common.write_json(args.out_dir, NAME, payload)
    plot(rows, args.out_dir / f"{NAME}.png", shape == QWEN3_30B_A3B and dtype == torch.bfloat16,
         f"{env['device']} | {args.dtype} | E{shape['num_experts']} top-{shape['top_k']} K{shape['hidden_size']} "
         f"N{shape['intermediate_size']} | torch {env['torch']} triton {env['triton']} | {env['date_utc']}")
    print_summary(rows, ceilings)
    return payload


def plot(rows, path, with_anchor, title):
    """Time per call vs M, log-log: one line per provider, the vLLM anchor dashed. Never raises (the
    JSON already holds every figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped {path}")
        return None
    try:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name in dict.fromkeys(r["provider"] for r in rows):
            points = [(r["M"], r["ms"]) for r in rows if r["provider"] == name and r.get("ms")]
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        if with_anchor:
            ax.plot(list(VLLM_FUSED_EXPERTS_MS), list(VLLM_FUSED_EXPERTS_MS.values()), "k--", marker="x",
                    label=VLLM_ANCHOR)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("ms per call")
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        return common.save_figure(fig, path)
    except Exception as exc:
        print(f"note: plotting failed ({type(exc).__name__}: {exc}); the JSON has every figure")
        return None


def print_summary(rows, ceilings):
    table = [[r["M"], r["provider"], r["status"], common.fmt(r.get("ms")), common.fmt(r.get("TFLOPs")),
              _percent(r.get("fraction_of_matmul")), common.fmt(r.get("weight_TBps")),
              _percent(r.get("fraction_of_copy")), common.fmt(r.get("vllm_ms")), common.fmt(r.get("vllm_over_ours")),
              common.fmt(r.get("ours_speedup")), common.fmt(r.get("max_abs_err"), 2)] for r in rows]
    common.print_table(
        ["M", "provider", "status", "ms", "TFLOP/s", "of matmul", "weight TB/s", "of copy", "vLLM ms",
         "vLLM / ours", "ours speedup", "max|err|"], table,
        title=f"Fused MoE (FLOPs = 2*M*topk*3*N*K; weight bytes = distinct experts hit * 3*N*K*itemsize; "
              f"matmul {common.fmt(ceilings['matmul']['TFLOPs'])} TFLOP/s, copy "
              f"{common.fmt(ceilings['copy']['TBps'])} TB/s; vLLM: {VLLM_ANCHOR})")


def _percent(fraction):
    return "-" if fraction is None or math.isnan(fraction) else f"{100 * fraction:.0f}%"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
