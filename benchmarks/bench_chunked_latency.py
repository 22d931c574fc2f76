"""Inter-token latency while a long prompt arrives: chunked prefill against whole-prompt prefill,
measured in one run.

N streams decode; then one long prompt arrives. Without chunked prefill its whole prefill is one
step and every stream waits for it; with a token budget the prompt is computed in chunks that
share steps with the streams' decodes. Reported per setting: the streams' longest gap between two
tokens while the prompt is prefilled, the median gap, their ratio, and the long prompt's time to
first token (TTFT). vLLM: benchmarks/benchmark_serving.py reports ITL/TTFT the same way.

    python -m benchmarks.bench_chunked_latency [--prompt-len 16384] [--budget 2048] [--num-streams 32]
    python -m benchmarks.bench_chunked_latency --cpu-smoke      # CPU, tiny model, seconds
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

NAME = "bench_chunked_latency"


def model_dir_for(args):
    if args.model:
        return Path(args.model)
    from minivllm.tools.make_model import make_model

    out = Path(args.model_cache) / f"random-{args.preset}-{args.dtype}"
    return Path(make_model(args.preset, out, seed=0, dtype=args.dtype))


def run_scenario(model_dir, args, chunked):
    """Stream tokens, let the long prompt arrive, and time every step that gives the streams a token.

    Returns the gaps (seconds) between consecutive stream tokens from `--steady-steps` before the
    arrival until the long prompt's first token plus as many steps, and its TTFT.
    """
    from minivllm import LLM, SamplingParams
    from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID

    max_model_len = args.prompt_len + args.stream_prompt_len + args.max_tokens + 8
    budget = args.budget if chunked else max_model_len
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=max_model_len, max_num_batched_tokens=budget,
              max_num_seqs=max(args.num_streams + 1, 2), enable_chunked_prefill=chunked,
              enable_prefix_caching=False)
    vocab = llm.config.hf_config.vocab_size
    stream_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    stream_seqs = []
    for i in range(args.num_streams):
        llm.add_request([(7 * i + j) % vocab for j in range(args.stream_prompt_len)], stream_params)
        stream_seqs.append(llm.scheduler.waiting[-1])

    def num_known_tokens(seq):  # under async scheduling the last token may still be on its way
        return seq.num_completion_tokens - (seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID)

    num_tokens = lambda: sum(map(num_known_tokens, stream_seqs))  # noqa: E731
    events = []  # (time, stream tokens so far) after each step that gave the streams tokens

    def step():  # a token counts once the host has it (the engine waited for it), so no extra sync
        llm.step()
        count = num_tokens()
        if not events or count > events[-1][1]:
            events.append((time.perf_counter(), count))

    while num_tokens() < args.num_streams * (args.steady_steps + 2):  # warm: every stream decoding
        step()
    first_event = len(events) - args.steady_steps
    variants_before = common.compiled_kernel_variants()
    arrival = time.perf_counter()
    long_prompt = [(13 * j + 5) % vocab for j in range(args.prompt_len)]
    llm.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=args.steady_steps + 2, ignore_eos=True))
    long_seq = llm.scheduler.waiting[-1]
    while num_known_tokens(long_seq) == 0:
        step()
    ttft = time.perf_counter() - arrival
    num_events = len(events)
    while len(events) < num_events + args.steady_steps and llm.has_unfinished_requests():
        step()
    llm.abort_all()
    variants_after = common.compiled_kernel_variants()
    times = [t for t, _ in events[first_event:]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    stats = llm.stats
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    median = statistics.median(gaps)
    return {"chunked_prefill": chunked, "max_num_batched_tokens": budget, "ttft_s": ttft,
            "max_gap_s": max(gaps), "median_gap_s": median, "max_over_median": max(gaps) / median,
            "num_gaps": len(gaps), "gaps_ms": [round(g * 1e3, 3) for g in gaps],
            "prefill_tokens": stats.num_prefill_tokens,
            # Triton kernel variants compiled while measuring (None on the interpreter): > 0 means
            # a compile, not the schedule, made the longest gap
            "kernels_compiled_while_measuring": None if variants_before is None else variants_after - variants_before}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an existing model directory (default: make --preset once)")
    parser.add_argument("--preset", default="qwen3-0.6b", help="make_model preset when --model is not given")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "minivllm-bench-models"))
    parser.add_argument("--num-streams", type=int, default=32, help="sequences decoding when the prompt arrives")
    parser.add_argument("--stream-prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens each stream may generate")
    parser.add_argument("--prompt-len", type=int, default=16384, help="the long prompt that arrives")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens with chunked prefill")
    parser.add_argument("--steady-steps", type=int, default=20,
                        help="stream steps measured before the arrival and after the first token")
    return common.add_common_args(parser)


CPU_SMOKE = dict(preset="qwen3-tiny", num_streams=4, stream_prompt_len=8, max_tokens=64, prompt_len=200,
                 budget=32, steady_steps=4)


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, env = run.args, run.env
    print(f"{NAME}: {env['device']}, torch {env['torch']}, {args.dtype}; {args.num_streams} streams, "
          f"a {args.prompt_len}-token prompt arrives", flush=True)
    model_dir = model_dir_for(args)
    results = []
    for chunked in (True, False):
        result = run_scenario(model_dir, args, chunked)
        results.append(result)
        print(f"  chunked prefill {'on ' if chunked else 'off'} (budget {result['max_num_batched_tokens']}): "
              f"longest gap {result['max_gap_s'] * 1e3:.1f} ms, median {result['median_gap_s'] * 1e3:.2f} ms "
              f"({result['max_over_median']:.1f}x), TTFT {result['ttft_s'] * 1e3:.0f} ms, kernels compiled while "
              f"measuring: {result['kernels_compiled_while_measuring']}", flush=True)
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args),
               "model_dir": str(model_dir), "results": results}
    common.write_json(args.out_dir, NAME, payload)
    plot(results, args, env)
    common.print_table(
        ["chunked prefill", "budget", "longest gap ms", "median gap ms", "longest / median", "TTFT ms"],
        [["on" if r["chunked_prefill"] else "off", r["max_num_batched_tokens"], common.fmt(r["max_gap_s"] * 1e3),
          common.fmt(r["median_gap_s"] * 1e3), common.fmt(r["max_over_median"]), common.fmt(r["ttft_s"] * 1e3)]
         for r in results],
        title=f"{args.num_streams} streams decoding while a {args.prompt_len}-token prompt arrives")
    return payload


def plot(results, args, env):
    panels = [{"title": f"gap between stream tokens (ms), {args.num_streams} streams, "
                        f"{args.prompt_len}-token prompt arrives",
               "categories": ["longest gap", "median gap", "TTFT of the long prompt"],
               "series": {f"chunked prefill {'on' if r['chunked_prefill'] else 'off'}":
                          [r["max_gap_s"] * 1e3, r["median_gap_s"] * 1e3, r["ttft_s"] * 1e3] for r in results},
               "ylabel": "ms"}]
    common.plot_panels(args.out_dir / f"{NAME}.png", panels,
                       f"{env['device']} | {args.dtype} | {args.preset if not args.model else Path(args.model).name} "
                       f"| torch {env['torch']} | {env['date_utc']}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
