"""Tensor parallelism on two GPUs, the Qwen3-8B shape (random weights, bfloat16), four checks:

    logits      TP=2 against TP=1, teacher-forced (the same tokens fed to both): relative difference
                of the logits per (step, prompt) and agreement of their argmax
    graphs      TP=2 with CUDA graphs against TP=2 eager: greedy tokens, and decode step time
    throughput  bench_throughput's workload at TP=1 and TP=2 (minivllm only)
    profile     one TP=2 decode step on rank 0: kernel time by category, the all-reduces included

    python -m benchmarks.tp_two_gpu --out-dir DIR                    # all four (needs 2 GPUs)
    python -m benchmarks.tp_two_gpu --parts logits,graphs --out-dir DIR
    python -m benchmarks.tp_two_gpu --preset qwen3-tiny --parts logits,graphs,profile   # quick look

Each part writes DIR/tp_two_gpu_PART.json and prints a table.
"""
import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

PARTS = ("logits", "graphs", "throughput", "profile")
CATEGORIES = (("all-reduce / gather (NCCL)", ("nccl",)),
              ("attention", ("attn", "decode", "paged", "split")),
              ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "matmul")))


def engine(model_dir, tp, args, **overrides):
    from minivllm import LLM

    options = dict(dtype=args.dtype, device=args.device, tensor_parallel_size=tp, max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization)
    return LLM(str(model_dir), **{**options, **overrides})


def release(llm):
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def prompts(num, max_len, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def part_logits(model_dir, args):
    batch = prompts(16, 700, args.vocab)
    logits = {}
    for tp in (1, 2):
        llm = engine(model_dir, tp, args)
        logits[tp] = common.teacher_forced_logits(llm, batch, num_steps=4, vocab=args.vocab)
        release(llm)
    rel = {key: float((a - logits[2][key]).norm() / a.norm()) for key, a in logits[1].items()}
    same_argmax = sum(int(a.argmax() == logits[2][key].argmax()) for key, a in logits[1].items())
    result = {"num_logit_rows": len(rel), "max_relative_difference": max(rel.values()),
              "median_relative_difference": sorted(rel.values())[len(rel) // 2],
              "argmax_agreement": same_argmax / len(rel), "pass_threshold": 2e-2}
    result["pass"] = result["max_relative_difference"] < result["pass_threshold"]
    common.print_table(["what", "value"], [(k, common.fmt(v) if isinstance(v, float) else v) for k, v in result.items()],
                       title="TP=2 vs TP=1 logits, teacher-forced, bf16 (expect max relative difference < 2e-2)")
    return result


def part_graphs(model_dir, args):
    from minivllm import SamplingParams

    batch = prompts(48, 500, args.vocab, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tokens, seconds = {}, {}
    for eager in (True, False):
        llm = engine(model_dir, 2, args, enforce_eager=eager)
        assert (getattr(llm.model_runner, "graphs", None) is None) == (eager or args.device == "cpu")
        llm.generate(batch[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        seconds[eager] = time.perf_counter() - start
        release(llm)
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    result = {"prompts": len(batch), "identical_outputs": same, "eager_seconds": seconds[True],
              "graphs_seconds": seconds[False], "graphs_speedup": seconds[True] / seconds[False]}
    common.print_table(["what", "value"], [(k, common.fmt(v) if isinstance(v, float) else v) for k, v in result.items()],
                       title="TP=2: CUDA graphs vs eager, 48 prompts x 64 greedy tokens (expect all identical)")
    return result


def part_throughput(model_dir, args):
    from benchmarks import bench_throughput

    result = {}
    for tp in (1, 2):
        payload = bench_throughput.main(["--model", str(model_dir), "--skip-hf", "--tensor-parallel-size", str(tp),
                                         "--num-requests", str(args.num_requests),
                                         "--out-dir", str(Path(args.out_dir) / f"throughput_tp{tp}")])
        result[f"tp{tp}"] = payload["minivllm"]
    common.print_table(["tensor_parallel_size", "seconds", "output tok/s"],
                       [(k, common.fmt(v.get("seconds")), common.fmt(v.get("output_tok_per_s"))) for k, v in result.items()],
                       title=f"bench_throughput, {args.num_requests} requests")
    return result


def part_profile(model_dir, args):
    from benchmarks import profile_decode

    llm = engine(model_dir, 2, args, max_num_seqs=args.batch)
    profile_decode.fill_engine(llm, args.batch, args.context)
    step_ms = profile_decode.time_steps(llm, 20)
    trace = os.path.join(args.out_dir, "tp_two_gpu_decode_trace.json")
    kernels_ms, top = profile_decode.kernel_profile(llm, 5, trace, categories=CATEGORIES)
    release(llm)
    result = {"batch": args.batch, "context": args.context, "engine_step_ms": step_ms,
              "kernels_ms_per_step_rank0": kernels_ms, "top_kernels": top, "trace": trace}
    common.print_table(["kernel", "ms/step", "calls/step"], [(n, common.fmt(ms), c) for n, ms, c in top],
                       title="rank 0, one TP=2 decode step (CUDA graphs)")
    common.print_table(["what", "ms per decode step"], [("engine step", common.fmt(step_ms))] +
                       [(k, common.fmt(v)) for k, v in sorted(kernels_ms.items())],
                       title=f"TP=2 decode, batch {args.batch}, context {args.context}")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--model", help="an existing model directory (default: make --preset once)")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "minivllm-bench-models"))
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--num-requests", type=int, default=256, help="throughput part")
    parser.add_argument("--batch", type=int, default=128, help="profile part: sequences decoding")
    parser.add_argument("--context", type=int, default=1024, help="profile part: prompt tokens per sequence")
    parser.add_argument("--out-dir", default=str(common.default_out_dir()))
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the logits and graphs parts on the CPU (gloo, float32, qwen3-tiny): checks the script")
    args = parser.parse_args(argv)
    args.dtype, args.device = "bfloat16", "cuda"
    if args.cpu_smoke:
        common.use_interpreter_without_cuda()
        args.preset, args.dtype, args.device, args.max_model_len, args.max_num_seqs = "qwen3-tiny", "float32", "cpu", 1024, 64
    elif torch.cuda.device_count() < 2:
        raise SystemExit(f"tp_two_gpu needs 2 GPUs, this host has {torch.cuda.device_count()}")
    from minivllm.tools.make_model import make_model

    model_dir = Path(args.model or make_model(args.preset, Path(args.model_cache) / f"random-{args.preset}-{args.dtype}",
                                              seed=0, dtype=args.dtype, init_device=args.device))
    args.vocab = min(10000, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    os.makedirs(args.out_dir, exist_ok=True)
    for part in args.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; parts: {PARTS}")
        print(f"== {part} ({model_dir.name})", flush=True)
        result = {"part": part, "model_dir": str(model_dir), "environment": common.environment(),
                  "options": vars(args), **globals()[f"part_{part}"](model_dir, args)}
        common.write_json(args.out_dir, f"tp_two_gpu_{part}", result)


if __name__ == "__main__":
    main()
