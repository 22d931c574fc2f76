"""Where a decode step's time goes: engine step vs graph replay vs the kernels inside it.

Fills the engine with --batch requests of --context prompt tokens, then times decode steps three
ways: the whole engine step (scheduling, input staging, forward, sampling), the CUDA-graph replay
alone, and, with the torch profiler, the GPU kernels (attention, GEMMs, the rest), eager and with
graphs. The target: engine step <= 1.3 x (attention + GEMM kernel time).

    python -m benchmarks.profile_decode --batch 256 --context 1024 --out-dir DIR
    python -m benchmarks.profile_decode --batch 1 --label no_gemv --engine-args '{"small_batch_gemv": false}'
    python -m benchmarks.profile_decode --preset qwen3-30b-a3b --load-format dummy --batch 64 --label moe

At batch 1 the replay's time less the sum of its kernels' times is the bubbles between kernels (launch
gaps inside the graph), printed as "gaps inside the graph".
"""
import argparse
import contextlib
import os
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

from benchmarks import common

CATEGORIES = (("attention", ("attn", "decode", "paged", "split")), ("moe", ("moe",)),
              ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "matmul")))




def fill_engine(llm, batch, context, seed=0):
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(batch):
        llm.add_request(torch.randint(0, 10000, (context,), generator=gen).tolist(), params)
    while llm.scheduler.waiting or any(seq.is_prefilling for seq in llm.scheduler.running):
        llm.step()


@contextlib.contextmanager
def graphs_off(runner):
    """The runner's decode steps eagerly, its CUDA graphs set aside: to DecodeCUDAGraphs every batch is
    then beyond the largest graph (max_batch_size 0, no graph of any size), which is its eager path."""
    graphs = runner.graphs
    runner.graphs = SimpleNamespace(max_batch_size=0, graphs={})
    try:
        yield
    finally:
        runner.graphs = graphs


def time_steps(llm, num_steps):
    common.sync()
    start = time.perf_counter()
    for _ in range(num_steps):
        llm.step()
    common.sync()
    return (time.perf_counter() - start) * 1000 / num_steps


def time_replay(runner, batch, num_steps):
    bs = runner.graphs.batch_size_for(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_steps):
        runner.graphs.replay(bs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / num_steps


def kernel_profile(llm, num_steps, trace_path=None, categories=CATEGORIES):
    """GPU kernel time per decode step, by category (the first rule whose fragment the kernel's name
    holds), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            llm.step()
        common.sync()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    totals, kernels = defaultdict(float), []
    for event in prof.key_averages():
        if "CUDA" not in str(getattr(event, "device_type", "")):
            continue  # CPU-side ops; kernels are the events that ran on the device
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        totals[common.kernel_category(event.key, categories)] += device_us / 1000 / num_steps
        kernels.append((event.key[:70], device_us / 1000 / num_steps, event.count // num_steps))
    kernels.sort(key=lambda k: -k[1])
    return dict(totals), kernels[:24]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: --preset's random checkpoint, made once)")
    parser.add_argument("--preset", default="qwen3-0.6b", help="make_model preset when --model is not given")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: a config-only directory of --preset; the engine draws random weights on the GPU "
                             "(a large model, e.g. qwen3-30b-a3b, without writing its checkpoint)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out-dir", default=str(common.default_out_dir()))
    common.add_engine_args(parser)
    parser.add_argument("--label", default="", help="suffix of the output files (an A/B run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode needs CUDA")
    from minivllm import LLM
    from benchmarks.bench_throughput import model_dir_for

    model_dir = str(model_dir_for(SimpleNamespace(  # (bench_throughput's: a random checkpoint, or a config dir)
        model=args.model, preset=args.preset, load_format=args.load_format, dtype="bfloat16", init_device="cpu",
        model_cache=os.path.join("/tmp", "minivllm-bench-models"))))
    llm = LLM(model_dir, max_num_seqs=args.batch, max_model_len=args.context + 2 * args.steps + 64,
              **{"dtype": "bfloat16", "load_format": args.load_format,
                 **args.engine_args})  # (--engine-args '{"dtype": "float32"}' overrides it)
    fill_engine(llm, args.batch, args.context)
    runner = llm.model_runner
    result = {"batch": args.batch, "context": args.context, "engine_args": args.engine_args,
              "env": common.environment()}
    name = "profile_decode" + (f"_{args.label}" if args.label else "")
    result["graph_step_ms"] = time_steps(llm, args.steps)
    result["graph_replay_ms"] = time_replay(runner, args.batch, args.steps)
    os.makedirs(args.out_dir, exist_ok=True)
    result["graph_kernels_ms"], result["graph_top"] = kernel_profile(
        llm, 5, os.path.join(args.out_dir, f"{name}_graphs_trace.json"))
    result["graph_kernels_sum_ms"] = sum(result["graph_kernels_ms"].values())
    result["graph_gaps_ms"] = result["graph_replay_ms"] - result["graph_kernels_sum_ms"]
    result["graph_kernels_per_step"] = sum(n for _, _, n in result["graph_top"])
    common.write_json(args.out_dir, name, result)  # the graph figures, should the eager part fail
    with graphs_off(runner):  # eager: the same steps without CUDA graphs
        result["eager_step_ms"] = time_steps(llm, args.steps)
        result["eager_kernels_ms"], result["eager_top"] = kernel_profile(
            llm, 5, os.path.join(args.out_dir, f"{name}_eager_trace.json"))
    attn_gemm = result["eager_kernels_ms"].get("attention", 0) + result["eager_kernels_ms"].get("gemm", 0)
    result["attention_plus_gemm_ms"] = attn_gemm
    result["step_over_attention_plus_gemm"] = result["graph_step_ms"] / attn_gemm if attn_gemm else None
    common.write_json(args.out_dir, name, result)
    rows = [(kernel, common.fmt(ms), n) for kernel, ms, n in result["graph_top"]]
    common.print_table(["kernel (CUDA graphs)", "ms/step", "calls/step"], rows, title="top kernels, graph replays")
    common.print_table(["what", "ms per decode step"], [
        ("engine step, CUDA graphs", common.fmt(result["graph_step_ms"])),
        ("graph replay alone", common.fmt(result["graph_replay_ms"])),
        ("kernels inside the graph, summed", common.fmt(result["graph_kernels_sum_ms"])),
        ("gaps inside the graph (replay - kernels)", common.fmt(result["graph_gaps_ms"])),
        ("engine step, eager", common.fmt(result["eager_step_ms"])),
        *((f"kernels eager: {k}", common.fmt(v)) for k, v in sorted(result["eager_kernels_ms"].items())),
        *((f"kernels graphs: {k}", common.fmt(v)) for k, v in sorted(result["graph_kernels_ms"].items())),
        ("step / (attention + GEMM)", common.fmt(result["step_over_attention_plus_gemm"])),
    ], title=f"decode step, batch {args.batch}, context {args.context}")


if __name__ == "__main__":
    main()
