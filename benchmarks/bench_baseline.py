"""Chapter 00's measurement: the naive baseline (minivllm/baseline.py) against the engine, on the
same requests, the same weights and the same device, counting only the tokens each request asked for.

    python -m benchmarks.bench_baseline                     # CPU: qwen3-tiny, 16 requests, seconds
    python -m benchmarks.bench_baseline --preset qwen3-0.6b --num-requests 256 --max-len 1024   # GPU

Both run greedy; the script checks that their tokens agree (exactly in float32; in bfloat16 rounding
can tip a near-tie, so it reports the share of requests that agree).
"""
import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams, baseline
from minivllm.tools.make_model import make_model


def make_requests(num_requests, min_len, max_len, vocab_size, seed=0):
    """Random prompts and output lengths, each drawn uniformly from [min_len, max_len]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_requests)]


def print_waste(prompts, output_lens):
    """What the static, padded batch computes and reserves beyond what the requests need."""
    batch, prompt_len, num_steps = len(prompts), max(len(p) for p in prompts), max(output_lens)
    needed_prefill = sum(len(p) for p in prompts)
    needed_decode = sum(n - 1 for n in output_lens)  # the first token comes out of the prefill
    needed_slots = sum(len(p) + n for p, n in zip(prompts, output_lens))
    for what, computed, needed in (("prefill tokens", batch * prompt_len, needed_prefill),
                                   ("decode rows", batch * (num_steps - 1), needed_decode),
                                   ("KV slots reserved", batch * (prompt_len + num_steps), needed_slots)):
        print(f"baseline {what:18s} {computed:8d}, needed {needed:8d} ({computed / needed:.2f}x)")


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_baseline(model, prompts, output_lens, device):
    baseline.generate(model, prompts[:2], 2)  # warm-up
    sync(device)
    start = time.perf_counter()
    completions = baseline.generate(model, prompts, output_lens)
    sync(device)
    return completions, time.perf_counter() - start


def run_engine(model_dir, prompts, output_lens, device, dtype, max_model_len):
    llm = LLM(str(model_dir), device=device, dtype=dtype, max_model_len=max_model_len)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return [out.outputs[0].token_ids for out in outputs], seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory; default: random weights of --preset")
    parser.add_argument("--preset", default="qwen3-tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    args = parser.parse_args(argv)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    with tempfile.TemporaryDirectory(prefix="minivllm-bench-baseline-") as workdir:
        model_dir = Path(args.model) if args.model else make_model(args.preset, Path(workdir) / args.preset, seed=0,
                                                                   dtype=dtype)
        model, _ = baseline.load(str(model_dir), dtype=getattr(torch, dtype), device=args.device)
        prompts, output_lens = make_requests(args.num_requests, args.min_len, args.max_len, model.config.vocab_size)
        print(f"{args.num_requests} requests, prompts and outputs of {args.min_len}-{args.max_len} tokens, "
              f"{sum(output_lens)} output tokens; {args.device}, {dtype}")
        print_waste(prompts, output_lens)
        ours, baseline_s = run_baseline(model, prompts, output_lens, args.device)
        del model
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory
        theirs, engine_s = run_engine(model_dir, prompts, output_lens, args.device, dtype, 2 * args.max_len + 16)
    num_tokens = sum(output_lens)
    for name, seconds in (("baseline", baseline_s), ("engine", engine_s)):
        print(f"{name:9s} {seconds:8.2f} s  {num_tokens / seconds:10.1f} output tokens/s")
    print(f"engine / baseline: {baseline_s / engine_s:.2f}x")
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy outputs identical: {same}/{len(prompts)} requests")


if __name__ == "__main__":
    main()
