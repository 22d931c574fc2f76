"""What one user feels: the decode step at small batches and the time to the first token, beside the
floor of each (what the weights and the KV cache take to read at the card's copy bandwidth).

    decode step at batch B   B requests of --prompt-len tokens decoding --output-len tokens, greedy:
                             the wall time per step once every request has its first token and
                             before any has finished (each step gives every request one token)
    TTFT at batch 1          one request of L prompt tokens: submission to its first token

Floor of a decode step: every weight once (the tied embedding / LM head once) plus the K and V of
every cached token, over the copy bandwidth measured in the same run. Floor of a prefill: the larger
of its matmul FLOPs over the matmul rate and the weights over the bandwidth. Only the public API
(LLM, add_request, step) is used, so the script measures any version of the engine alike.
vLLM: benchmarks/benchmark_latency.py.

    python -m benchmarks.bench_latency [--model DIR] [--batches 1 4 16 64] [--ttft-lens 128 1024 8192]
    python -m benchmarks.bench_latency --label no_gemv --engine-args '{"small_batch_gemv": false}'  # cuBLAS linears
    python -m benchmarks.bench_latency --tiny      # CPU, a few seconds
"""
import argparse
import random
import statistics
import time

import torch

from benchmarks import common

NAME = "bench_latency"
SMOKE = dict(preset="qwen3-tiny", batches=[1, 2], prompt_len=32, output_len=8, ttft_lens=[16, 64], repeats=1)


def parse_args(argv=None):
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--model", default=None, help="a model directory (default: a random --preset checkpoint)")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ttft-lens", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--repeats", type=int, default=3, help="TTFT measurements per length (the median is kept)")
    parser.add_argument("--label", default="minivllm", help="names this engine in the JSON (an A/B run)")
    common.add_engine_args(parser)
    return common.start_run(parser, argv, SMOKE)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run_stream(llm, prompts, max_tokens):
    """Submit `prompts` at once and step until done; per step (time, {request id: new tokens})."""
    from minivllm import SamplingParams
    from minivllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    steps = []
    while llm.has_unfinished_requests():
        outputs = llm.step()
        steps.append((time.perf_counter(), {o.request_id: len(o.outputs[0].token_ids) for o in outputs if o.outputs}))
    return start, ids, steps


def decode_step_ms(llm, batch, prompt_len, output_len, rng, vocab) -> float:
    """Wall ms per step between the step where the last request got its first token and the first
    step where one got its last."""
    _, ids, steps = run_stream(llm, [random_prompt(rng, prompt_len, vocab) for _ in range(batch)], output_len)
    counts, first_done, last_start = dict.fromkeys(ids, 0), None, None
    for i, (_, new) in enumerate(steps):
        for rid, n in new.items():
            counts[rid] += n
        if last_start is None and all(counts.values()):
            last_start = i
        if first_done is None and any(c == output_len for c in counts.values()):
            first_done = i
    assert last_start is not None and first_done > last_start, "too few decode steps to time"
    return (steps[first_done][0] - steps[last_start][0]) * 1e3 / (first_done - last_start)


def ttft_ms(llm, prompt_len, rng, vocab) -> float:
    start, _, steps = run_stream(llm, [random_prompt(rng, prompt_len, vocab)], 2)
    return (next(t for t, new in steps if any(new.values())) - start) * 1e3


def model_bytes(llm) -> tuple[int, int, int]:
    """(weight bytes, KV bytes per token, matmul FLOPs per token of a prompt) of the engine's model."""
    model, hf = llm.model_runner.model, llm.config.hf_config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * llm.config.torch_dtype.itemsize
    embed = hf.vocab_size * hf.hidden_size
    linear_params = sum(p.numel() for p in model.parameters()) - embed  # every weight but the embedding
    return weights, kv_per_token, 2 * linear_params


def floors(llm, args, copy_tbps, matmul_tflops) -> dict:
    weights, kv_per_token, flops_per_token = model_bytes(llm)
    hf = llm.config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    context = args.prompt_len + args.output_len / 2  # the mean context over the timed steps
    decode = {b: (weights + b * context * kv_per_token) / (copy_tbps * 1e12) * 1e3 for b in args.batches}
    ttft = {}
    for n in args.ttft_lens:
        attention = 2 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * n * n  # causal QK^T and PV
        ttft[n] = max((flops_per_token * n + attention) / (matmul_tflops * 1e12), weights / (copy_tbps * 1e12)) * 1e3
    return {"decode_ms": decode, "ttft_ms": ttft, "weight_bytes": weights, "kv_bytes_per_token": kv_per_token}


def main(argv=None):
    run = parse_args(argv)
    args = run.args
    from minivllm import LLM

    model = args.model or str(_model_dir(args))
    copy = common.measure_copy_bandwidth(args.copy_bytes or (1 << 30 if run.on_cuda else 1 << 24))
    matmul = common.measure_matmul_rate(8192 if run.on_cuda else 256, run.dtype)
    max_len = max(args.prompt_len + args.output_len, max(args.ttft_lens) + 2) + 16
    llm = LLM(model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=max(args.batches), **args.engine_args)
    rng = random.Random(args.seed)
    vocab = min(10000, llm.config.hf_config.vocab_size)  # token ids below 10000, as the other workloads
    run_stream(llm, [random_prompt(rng, args.prompt_len, vocab) for _ in range(max(args.batches))], 4)  # warm-up
    decode = {b: decode_step_ms(llm, b, args.prompt_len, args.output_len, rng, vocab) for b in args.batches}
    ttft = {n: statistics.median(ttft_ms(llm, n, rng, vocab) for _ in range(args.repeats)) for n in args.ttft_lens}
    floor = floors(llm, args, copy["TBps"], matmul["TFLOPs"])
    llm.shutdown()
    payload = {"benchmark": NAME, "label": args.label, "environment": run.env, "options": common.options_dict(args),
               "copy": copy, "matmul": matmul, "decode_step_ms": decode, "ttft_ms": ttft, "floor": floor}
    common.write_json(args.out_dir, f"{NAME}_{args.label}" if args.label != "minivllm" else NAME, payload)
    rows = [[f"decode step, batch {b}", f"{decode[b]:.3f}", f"{floor['decode_ms'][b]:.3f}",
             f"{decode[b] / floor['decode_ms'][b]:.2f}x"] for b in args.batches]
    rows += [[f"TTFT, {n} prompt tokens", f"{ttft[n]:.2f}", f"{floor['ttft_ms'][n]:.3f}",
              f"{ttft[n] / floor['ttft_ms'][n]:.2f}x"] for n in args.ttft_lens]
    common.print_table(["what", "ms", "floor ms", "over the floor"], rows,
                       title=f"{NAME} ({args.label}): copy {copy['TBps']:.2f} TB/s, matmul {matmul['TFLOPs']:.0f} TFLOP/s")
    common.plot_panels(args.out_dir / f"{NAME}{'' if args.label == 'minivllm' else '_' + args.label}.png", [
        {"title": f"decode step ({args.prompt_len}-token prompts)", "categories": [f"batch {b}" for b in args.batches],
         "series": {"measured": [decode[b] for b in args.batches], "floor": [floor["decode_ms"][b] for b in args.batches]},
         "ylabel": "ms"},
        {"title": "time to first token, batch 1", "categories": [f"{n} tokens" for n in args.ttft_lens],
         "series": {"measured": [ttft[n] for n in args.ttft_lens], "floor": [floor["ttft_ms"][n] for n in args.ttft_lens]},
         "ylabel": "ms"}])
    return payload


def _model_dir(args):
    from minivllm.tools.make_model import make_model
    from minivllm.tools.tokenizer import minivllm_cache_dir

    return make_model(args.preset, minivllm_cache_dir() / f"random-{args.preset}", seed=0)


if __name__ == "__main__":
    main()
