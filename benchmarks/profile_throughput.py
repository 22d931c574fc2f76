"""Where the end-to-end workload's time goes: the bench_throughput run, traced whole.

Runs bench_throughput's workload twice on one engine: once timed, recording each engine step on
the host (prefill or decode, batch size, seconds), and once under the torch profiler, summing GPU
kernel time by category (decode attention, prefill attention, GEMM, sampling, ...) and the time the
GPU sat idle between kernels (host-bound stretches). Decode attention is set against the bytes it
must read, which gives its bandwidth over the real mix of context lengths.

    python -m benchmarks.profile_throughput [--model DIR] [--out-dir DIR]
"""
import argparse
import json
import os
import time
from collections import defaultdict

import torch

from benchmarks import common
from benchmarks.bench_throughput import make_workload, model_dir_for, roofline_floor

# First match wins; names are lower-cased kernel names.
CATEGORIES = (
    ("decode attention", ("paged_decode", "merge_splits")),
    ("prefill attention", ("flash_attn_varlen",)),
    ("kv store", ("store_kvcache",)),
    ("fp8 activation quant", ("quant",)),
    ("mixture of experts", ("fused_moe", "moe_align")),  # kernels/fused_moe.py's align and grouped GEMMs
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "matmul")),
    ("sampling", ("softmax", "exponential", "argmax", "argmin", "sampl", "gumbel", "distribution", "merge_chunks")),
    ("small fused ops", ("triton_", "silu_and_mul", "qk_norm_rope", "rms_norm")),  # triton_*: torch.compile's
    ("memcpy", ("memcpy", "memset")),
)


def category(kernel_name: str) -> str:
    return common.kernel_category(kernel_name, CATEGORIES)


def run_workload(llm, prompts, output_lens, temperature, record_steps=False):
    """Feed the requests, step the engine to the end; per step (kind, batch, host seconds)."""
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    assert llm.reset_prefix_cache()  # every run computes its prompts in full, like the first
    for prompt, n in zip(prompts, output_lens):
        llm.add_request(prompt, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n,
                                               output_kind=RequestOutputKind.FINAL_ONLY))
    steps, stats = [], llm.stats
    while llm.has_unfinished_requests():
        before = (stats.num_prefill_tokens, stats.num_decode_tokens)
        start = time.perf_counter()
        llm.step()
        seconds = time.perf_counter() - start
        if record_steps:
            prefill, decode = stats.num_prefill_tokens - before[0], stats.num_decode_tokens - before[1]
            steps.append(("prefill" if prefill else "decode", prefill or decode, seconds))
    return steps


def busy_seconds(intervals):
    """Length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e6


def kernel_summary(prof):
    """Kernel seconds by category, the top kernels, and the GPU's busy time (union of kernels),
    overall and in the prefill phase (up to the last prefill attention kernel)."""
    by_category, by_kernel, intervals = defaultdict(float), defaultdict(lambda: [0.0, 0]), []
    first, last, prefill_end, decode_kernels = float("inf"), 0.0, None, []
    for event in prof.events():
        if "CUDA" not in str(getattr(event, "device_type", "")):
            continue
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end))
        first, last = min(first, start), max(last, end)
        seconds = (end - start) / 1e6
        if category(event.name) == "prefill attention":
            prefill_end = max(prefill_end or 0.0, end)
        if event.name.startswith("paged_decode_kernel"):
            decode_kernels.append((start, seconds))
        by_category[category(event.name)] += seconds
        by_kernel[event.name[:80]][0] += seconds
        by_kernel[event.name[:80]][1] += 1
    top = sorted(((name, s, n) for name, (s, n) in by_kernel.items()), key=lambda k: -k[1])[:15]
    prefill = [iv for iv in intervals if prefill_end is not None and iv[0] < prefill_end]
    return {"by_category_s": dict(by_category), "top_kernels": top, "gpu_busy_s": busy_seconds(intervals),
            "gpu_span_s": (last - first) / 1e6 if intervals else 0.0,
            "prefill_phase_span_s": (prefill_end - first) / 1e6 if prefill else 0.0,
            "prefill_phase_busy_s": busy_seconds(prefill),
            "decode_kernel_seconds": [s for _, s in sorted(decode_kernels)]}


def attention_by_batch(decode_kernel_seconds, prompts, output_lens, num_layers, kv_bytes_per_token):
    """paged_decode kernel bandwidth by decode batch size. Decode step j (0-based) runs every request
    with more than j + 1 output tokens over its prompt + j + 1 cached tokens; the kernels come in
    steps of num_layers (one per layer). Returns {bucket: (steps, seconds, TB/s)}."""
    layer_bytes = kv_bytes_per_token / num_layers
    buckets = defaultdict(lambda: [0, 0.0, 0.0])
    num_steps = len(decode_kernel_seconds) // num_layers
    for j in range(num_steps):
        contexts = [p + j + 1 for p, n in zip(map(len, prompts), output_lens) if n > j + 1]
        if not contexts:
            continue
        seconds = sum(decode_kernel_seconds[j * num_layers:(j + 1) * num_layers])
        bucket = buckets[_bucket(len(contexts))]
        bucket[0] += 1
        bucket[1] += seconds
        bucket[2] += sum(contexts) * layer_bytes * num_layers
    return {k: (n, s, b / s / 1e12) for k, (n, s, b) in sorted(buckets.items())}


def host_profile_of_prefills(llm, prompts, output_lens, temperature):
    """CPU and CUDA time of the operators in the prefill steps of one more run (the top 15)."""
    from minivllm.sampling_params import RequestOutputKind, SamplingParams
    from torch.profiler import ProfilerActivity, profile

    assert llm.reset_prefix_cache()
    for prompt, n in zip(prompts, output_lens):
        llm.add_request(prompt, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n,
                                               output_kind=RequestOutputKind.FINAL_ONLY))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while llm.scheduler.waiting or any(seq.is_prefilling for seq in llm.scheduler.running):
            llm.step()
        common.sync()
        seconds = time.perf_counter() - start
    llm.abort_all()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50)
    return seconds, table


def summarise_steps(steps):
    """Host seconds and counts of prefill and decode steps, decode split by batch size."""
    out = defaultdict(lambda: {"steps": 0, "seconds": 0.0, "tokens": 0})
    for kind, tokens, seconds in steps:
        key = kind if kind == "prefill" else f"decode batch {_bucket(tokens)}"
        out[key]["steps"] += 1
        out[key]["seconds"] += seconds
        out[key]["tokens"] += tokens
    return dict(sorted(out.items()))


def _bucket(batch):
    for low, high in ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256)):
        if low <= batch <= high:
            return f"{low:>3}-{high}"
    return f"{batch}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model-cache", default="/tmp/minivllm-bench-models")
    parser.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"],
                        help="where make_model draws the random weights (cuda: seconds for an 8B model)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"],
                        help="fp8: the linear weights quantized to FP8 at load time (W8A8)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights drawn on the GPU from a config-only directory (--preset qwen3-30b-a3b)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=None, help="every prompt this long instead")
    parser.add_argument("--output-len", type=int, default=None, help="every output this long instead")
    parser.add_argument("--max-token-id", type=int, default=10000)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--trace", action="store_true", help="also write the chrome trace (large)")
    parser.add_argument("--prefill-host-profile", action="store_true",
                        help="also profile the operators (CPU side) of the prefill steps")
    parser.add_argument("--out-dir", default=str(common.default_out_dir()))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_throughput needs CUDA")
    from minivllm import LLM

    model_dir = model_dir_for(args)
    prompts, output_lens = make_workload(args.num_requests, args.min_len, args.max_len, args.max_token_id, args.seed,
                                         args.input_len, args.output_len)
    copy = common.measure_copy_bandwidth(2**30)
    floor = roofline_floor(model_dir, prompts, output_lens, args.max_num_seqs, 2, copy["TBps"], 700.0,
                           kv_itemsize=1 if args.kv_cache_dtype == "fp8" else None,
                           layer_weight_itemsize=1 if args.quantization == "fp8" else None)
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              async_scheduling=False if args.no_async else None, compile_small_ops=not args.no_compile,
              kv_cache_dtype=args.kv_cache_dtype, quantization=None if args.quantization == "none" else "fp8",
              load_format=args.load_format)
    run_workload(llm, [[1, 2, 3, 4]] * 4, [4] * 4, args.temperature)  # warm-up
    common.sync()
    start = time.perf_counter()
    steps = run_workload(llm, prompts, output_lens, args.temperature, record_steps=True)
    common.sync()
    wall = time.perf_counter() - start

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_workload(llm, prompts, output_lens, args.temperature)
        common.sync()
        profiled_wall = time.perf_counter() - start
    os.makedirs(args.out_dir, exist_ok=True)
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.out_dir, "profile_throughput_trace.json"))
    kernels = kernel_summary(prof)
    decode_attention = kernels["by_category_s"].get("decode attention", 0.0)
    result = {"env": common.environment(), "options": vars(args), "wall_s": wall, "profiled_wall_s": profiled_wall,
              "copy_TBps": copy["TBps"], "floor": {k: floor[k] for k in ("seconds", "kv_seconds", "weight_seconds",
                                                                           "prefill_seconds", "decode_kv_bytes")},
              "steps": summarise_steps(steps), **kernels,
              "decode_attention_TBps": floor["decode_kv_bytes"] / decode_attention / 1e12 if decode_attention else None,
              "output_tok_per_s": sum(output_lens) / wall}
    cfg = json.loads((model_dir / "config.json").read_text())
    result["attention_by_batch"] = attention_by_batch(
        result.pop("decode_kernel_seconds"), prompts, output_lens, cfg["num_hidden_layers"],
        floor["decode_kv_bytes"] / floor["decode_context_token_steps"])
    common.print_table(["decode batch", "steps", "attention s", "TB/s"],
                       [(k, n, f"{s:.3f}", f"{tb:.2f}") for k, (n, s, tb) in result["attention_by_batch"].items()],
                       title="paged_decode kernels by batch size (profiled run)")
    if args.prefill_host_profile:
        result["prefill_profiled_s"], table = host_profile_of_prefills(llm, prompts, output_lens, args.temperature)
        print(f"prefill steps under the CPU+CUDA profiler: {result['prefill_profiled_s']:.3f} s")
        print(table)
    common.write_json(args.out_dir, "profile_throughput", result)
    common.print_table(["kernel", "s", "calls"], [(n[:60], f"{s:.3f}", c) for n, s, c in kernels["top_kernels"]],
                       title="top kernels (profiled run)")
    common.print_table(["engine steps (timed run)", "steps", "host s", "tokens", "ms/step"],
                       [(k, v["steps"], f"{v['seconds']:.3f}", v["tokens"], f"{1000 * v['seconds'] / v['steps']:.2f}")
                        for k, v in result["steps"].items()])
    rows = [(k, f"{v:.3f}") for k, v in sorted(kernels["by_category_s"].items(), key=lambda kv: -kv[1])]
    rows += [("GPU busy (union of kernels)", f"{kernels['gpu_busy_s']:.3f}"),
             ("GPU idle within the profiled run", f"{profiled_wall - kernels['gpu_busy_s']:.3f}"),
             ("  prefill phase: span / GPU busy", f"{kernels['prefill_phase_span_s']:.3f} / "
                                                 f"{kernels['prefill_phase_busy_s']:.3f}"),
             ("profiled wall", f"{profiled_wall:.3f}"), ("timed wall (no profiler)", f"{wall:.3f}"),
             ("floor", f"{floor['seconds']:.3f}"),
             ("decode attention TB/s over the workload", common.fmt(result["decode_attention_TBps"]))]
    common.print_table(["where the time goes", "seconds"], rows,
                       title=f"{sum(output_lens) / wall:,.0f} output tok/s, copy {copy['TBps']:.2f} TB/s")


if __name__ == "__main__":
    main()
