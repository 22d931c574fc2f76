"""End-to-end offline throughput: minivllm's `LLM.generate` against transformers `generate`
(static batches, SDPA) on the same requests in the same run, beside the workload's roofline floor.
vLLM: benchmarks/benchmark_throughput.py; the workload is nano-vllm's bench.py.

    python -m benchmarks.bench_throughput [--model DIR] [--hf-requests 64] [--out-dir DIR]
    python -m benchmarks.bench_throughput --compare-chunked-prefill --skip-hf   # chunked prefill on and off
    python -m benchmarks.bench_throughput --kv-cache-dtype fp8 --skip-hf   # FP8 KV cache (run auto back to back)
    python -m benchmarks.bench_throughput --quantization fp8 --skip-hf     # FP8 weights (W8A8), same
    python -m benchmarks.bench_throughput --kv-cache-dtype fp8 --compare-unquantized --skip-hf  # and bf16, same run
    python -m benchmarks.bench_throughput --preset qwen3-8b --quantization fp8 --compare-unquantized \
        --num-requests 128 --input-len 256 --output-len 512 --skip-hf   # decode-heavy, FP8 weights vs bf16
    python -m benchmarks.bench_throughput --tiny      # CPU, a few seconds
    python -m benchmarks.bench_throughput --preset qwen3-8b --tensor-parallel-size 2 --skip-hf   # two GPUs
"""
import argparse
import gc
import json
import math
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

NAME = "bench_throughput"
WORKLOAD_PROCEDURE = (
    "nano-vllm bench.py: random.seed(seed); prompt_token_ids = [[randint(0, max_token_id) for _ in "
    "range(randint(min_len, max_len))] for _ in range(num_requests)]; then, after all prompts, "
    "max_tokens = randint(min_len, max_len) per request (random.randint is inclusive at both ends, "
    "so ids are in [0, max_token_id]); ignore_eos=True, so every request emits exactly max_tokens")


# ----------------------------------------------------------------------------- workload

def make_workload(num_requests, min_len, max_len, max_token_id, seed, input_len=None, output_len=None):
    """The requests, drawn exactly as nano-vllm's bench.py draws them (see WORKLOAD_PROCEDURE).

    input_len / output_len: every prompt / output that long instead (the ids are still drawn).
    """
    rng = random.Random(seed)  # same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, max_token_id) for _ in range(input_len or rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    output_lens = [output_len or rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, output_lens


def model_dir_for(args, quantization=None):
    """--model, or a random-weight checkpoint of --preset (make_model reuses a complete one);
    quantization="fp8": the block-FP8 checkpoint of the same random weights. With --load-format dummy
    (the scripts that have the flag) a config-only directory instead."""
    if args.model:
        return Path(args.model)
    from minivllm.tools.make_model import make_config_dir, make_model

    if getattr(args, "load_format", "auto") == "dummy":  # config and tokenizer only: the engine draws the weights on the device
        out = Path(args.model_cache) / f"config-{args.preset}"
        print(f"model: {args.preset}, random weights drawn by the engine (load_format dummy); config in {out}",
              flush=True)
        return make_config_dir(args.preset, out)

    suffix = "-fp8-block" if quantization else ""
    out = Path(args.model_cache) / f"random-{args.preset}-{args.dtype}{suffix}"
    print(f"model: {args.preset} random weights{' (block-FP8)' if quantization else ''} in {out}", flush=True)
    return Path(make_model(args.preset, out, seed=0, dtype=args.dtype, quantization=quantization,
                           init_device=args.init_device))


def is_quantized(args) -> bool:
    return args.kv_cache_dtype != "auto" or args.quantization != "none" or args.fp8_checkpoint


def unquantized(args):
    """The same options with the bf16 (model dtype) cache and weights: --compare-unquantized's baseline."""
    return argparse.Namespace(**{**vars(args), "kv_cache_dtype": "auto", "quantization": "none",
                                 "calculate_kv_scales": False, "fp8_checkpoint": False})


# ----------------------------------------------------------------------------- the floor

def count_params(model_dir):
    """Parameter counts from the safetensors headers (no weights loaded): embedding, lm_head
    (0 when tied), a mixture of experts' expert weights (`.mlp.experts.`, 0 for a dense model), and
    everything else (`layers`: attention, norms, dense MLPs, routers)."""
    counts = {"embedding": 0, "lm_head": 0, "experts": 0, "layers": 0}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:  # a config-only directory (load_format dummy): the transformers model's shapes, on no device
        return _count_params_of_config(model_dir, counts)
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                counts[_param_kind(name)] += math.prod(info["shape"])
    return counts


def _param_kind(name):
    return ("embedding" if "embed_tokens" in name else "lm_head" if "lm_head" in name
            else "experts" if ".mlp.experts." in name else "layers")


def _count_params_of_config(model_dir, counts):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: nothing is allocated
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    for name, param in model.named_parameters():  # a tied lm_head is the embedding: named once
        counts[_param_kind(name)] += param.numel()
    return counts


def expert_fraction_read(num_tokens, num_experts, top_k):
    """The expected fraction of a layer's experts that a step of num_tokens tokens reads, each token
    routed to top_k distinct experts uniformly and independently of the others (an assumption: trained
    routers are skewed, and tokens of one sequence share experts): 1 - (1 - top_k / E)^num_tokens."""
    return 1 - (1 - top_k / num_experts) ** num_tokens


def roofline_floor(model_dir, prompts, output_lens, max_num_seqs, itemsize, copy_tbps, matmul_tflops,
                   kv_itemsize=None, layer_weight_itemsize=None):
    """Seconds the workload needs at least on this card: decode reads every context token's K/V
    in every layer at every step, and all weights once per step; prefill is matmul-bound.

    decode KV bytes = sum over requests, over decode steps j = 1..n-1 (the first output token
        comes from the prefill) of context (prompt + j) x layers x 2 (K, V) x kv_heads x head_dim x
        kv_itemsize (the cache's bytes per element: the weights' itemsize, or 1 for an FP8 cache)
    decode steps >= max(longest output - 1, ceil(decode tokens / max_num_seqs)): a lower bound
        on the schedule (requests run at most max_num_seqs at a time, and a request's steps are serial)
    weight bytes per step = layer weights x layer_weight_itemsize (the weights' itemsize, or 1 for
        FP8 weights: norms, a few KB, counted at 1 byte too) + the vocab x hidden lm_head x itemsize
    a mixture of experts (config num_experts E, num_experts_per_tok k): the experts' weights are
        read as the steps' tokens pick them. In units of "every expert once", a step of b tokens
        reads f(b) = expert_fraction_read(b, E, k); f is concave with f(0) = 0, so f(b) >= b x
        f(max_num_seqs) / max_num_seqs, and f(b) >= k / E for b >= 1. The decode's expert bytes are
        at least max(decode tokens x f(max_num_seqs) / max_num_seqs, decode steps x k / E) x expert
        weights x itemsize; each token's FLOPs count k / E of the experts' parameters.
    prefill FLOPs = 2 x active layer params x prompt tokens + 2 x vocab x hidden per request (logits
        of the last prompt token only) + attention 2 x layers x heads x S^2 x head_dim per prompt
        (causal convention of bench_prefill); active = layers + experts x k / E (all of a dense
        model's); decode GEMM FLOPs are reported but not in the floor.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    params = count_params(model_dir)
    lm_head_params = cfg["vocab_size"] * cfg["hidden_size"]
    kv_bytes_per_token = layers * 2 * kv_heads * head_dim * (kv_itemsize or itemsize)
    decode_token_steps = sum((n - 1) * p + (n - 1) * n // 2 for p, n in
                             zip(map(len, prompts), output_lens))  # sum of (p + j), j = 1..n-1
    decode_tokens = sum(n - 1 for n in output_lens)
    decode_steps = max(max(output_lens) - 1, math.ceil(decode_tokens / max_num_seqs))
    weight_itemsize = layer_weight_itemsize or itemsize
    weight_bytes_per_step = params["layers"] * weight_itemsize + lm_head_params * itemsize
    # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts)
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    expert_reads, active_expert_params = 0.0, 0.0  # expert reads in units of "every expert once"
    if params["experts"]:
        assert num_experts and top_k, f"{model_dir}: expert weights but no num_experts / num_experts_per_tok"
        expert_reads = max(decode_tokens * expert_fraction_read(max_num_seqs, num_experts, top_k) / max_num_seqs,
                           decode_steps * top_k / num_experts)
        active_expert_params = params["experts"] * top_k / num_experts
    expert_bytes = expert_reads * params["experts"] * weight_itemsize
    active_layer_params = params["layers"] + active_expert_params  # what one token's forward multiplies
    prefill_flops = (2 * active_layer_params * sum(map(len, prompts)) + 2 * lm_head_params * len(prompts)
                     + 2 * layers * heads * head_dim * sum(len(p) ** 2 for p in prompts))
    floor = {
        "kv_bytes_per_context_token": kv_bytes_per_token,
        "decode_context_token_steps": decode_token_steps,
        "decode_kv_bytes": decode_token_steps * kv_bytes_per_token,
        "decode_steps_lower_bound": decode_steps,
        "weight_bytes_per_step": weight_bytes_per_step,  # without the experts (a dense model: all)
        "decode_expert_reads": expert_reads,
        "decode_expert_bytes": expert_bytes,
        "decode_weight_bytes": decode_steps * weight_bytes_per_step + expert_bytes,
        "prefill_flops": prefill_flops,
        "decode_matmul_flops_not_in_floor": 2 * (active_layer_params + lm_head_params) * decode_tokens,
        "params": params,
        "copy_TBps": copy_tbps,
        "matmul_TFLOPs": matmul_tflops,
    }
    floor["kv_seconds"] = floor["decode_kv_bytes"] / (copy_tbps * 1e12)
    floor["weight_seconds"] = floor["decode_weight_bytes"] / (copy_tbps * 1e12)
    floor["prefill_seconds"] = prefill_flops / (matmul_tflops * 1e12)
    floor["seconds"] = floor["kv_seconds"] + floor["weight_seconds"] + floor["prefill_seconds"]
    return floor


# ----------------------------------------------------------------------------- the two engines

def other_chunking(first_result: dict) -> bool:
    """--compare-chunked-prefill's second setting: the opposite of what the first run used (which may
    be the engine's default, on)."""
    return first_result.get("engine", {}).get("enable_chunked_prefill") != "True"


def run_minivllm(model_dir, prompts, output_lens, args, chunked_prefill: bool | None):
    """chunked_prefill: True/False, or None for the engine's default (on). The checkpoint's own
    quantization_config (a block-FP8 checkpoint) needs no quantization argument."""
    from minivllm import LLM, SamplingParams

    budget = {} if args.max_num_batched_tokens is None else dict(max_num_batched_tokens=args.max_num_batched_tokens)
    if args.max_prompt_graph_tokens is not None:
        budget["max_prompt_graph_tokens"] = args.max_prompt_graph_tokens
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.eager,
              async_scheduling=False if args.no_async else None, compile_small_ops=not args.no_compile,
              tensor_parallel_size=args.tensor_parallel_size, enable_chunked_prefill=chunked_prefill,
              kv_cache_dtype=args.kv_cache_dtype, quantization=None if args.quantization == "none" else args.quantization,
              calculate_kv_scales=args.calculate_kv_scales and args.kv_cache_dtype != "auto",
              load_format=args.load_format, **budget, **args.engine_args)
    warmup = [[1 + i for i in range(8)], [2 + i for i in range(12)]]
    llm.generate(warmup, SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=4), use_tqdm=False)
    extras = dict(logprobs=args.logprobs, repetition_penalty=args.repetition_penalty)  # defaults: the plain path
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, **extras) for n in output_lens]
    common.sync()
    variants_before = common.compiled_kernel_variants()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    common.sync()
    seconds = time.perf_counter() - start
    variants_after = common.compiled_kernel_variants()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    weights = "block-FP8" if args.fp8_checkpoint else "FP8 (at load)" if args.quantization == "fp8" else "unquantized"
    result = {"seconds": seconds, "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "weights": weights,
              # Triton kernel variants compiled inside the timed run (None on the interpreter)
              "kernels_compiled_while_measuring": None if variants_before is None else variants_after - variants_before,
              "output_tokens": output_tokens, "requested_output_tokens": sum(output_lens),
              "engine": {k: str(getattr(llm.config, k, None)) for k in (
                  "device", "torch_dtype", "kv_cache_torch_dtype", "quantization", "calculate_kv_scales", "attention_backend", "enforce_eager", "max_num_seqs",
                  "max_num_batched_tokens", "max_model_len", "kvcache_block_size", "num_kvcache_blocks",
                  "enable_prefix_caching", "async_scheduling", "compile_small_ops", "tensor_parallel_size",
                  "enable_chunked_prefill", "max_prompt_graph_tokens")}}
    llm.shutdown()
    del llm, outputs
    _release_memory()
    return _rates(result)


def run_hf(model_dir, prompts, output_lens, args, dtype, device):
    """transformers `generate` in static batches of --hf-batch, left-padded, greedy.

    Every request of a batch runs until the batch's longest output (min_new_tokens keeps EOS from
    ending it early); only each request's own output length counts as useful tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True).to(device).eval()
    cfg = model.config
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    _hf_generate(model, [[1, 2, 3, 4], [5, 6]], 4, pad_id, device)  # warm-up
    common.sync()
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), args.hf_batch):
        batch_lens = output_lens[i:i + args.hf_batch]
        out_len = _hf_generate(model, prompts[i:i + args.hf_batch], max(batch_lens), pad_id, device)
        generated += out_len * len(batch_lens)
        if out_len < max(batch_lens):
            raise RuntimeError(f"HF generate stopped at {out_len} < {max(batch_lens)} new tokens")
    common.sync()
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens": sum(output_lens), "generated_tokens_including_padding_steps": generated,
              "hf_batch": args.hf_batch, "attn_implementation": "sdpa", "decoding": "greedy"}
    del model
    _release_memory()
    return _rates(result)


def _hf_generate(model, prompts, new_tokens, pad_id, device):
    """One left-padded static batch; returns how many new tokens were generated per row."""
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out.shape[1] - width


def _rates(result):
    result["output_tok_per_s"] = result["output_tokens"] / result["seconds"]
    result["total_tok_per_s"] = (result["output_tokens"] + result["prompt_tokens"]) / result["seconds"]
    return result


def _release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"  CUDA memory still allocated: {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)


# ----------------------------------------------------------------------------- main

def add_workload_args(parser):
    """The model and the requests: the flags every script on this workload shares (bench_ladder too)."""
    parser.add_argument("--model", help="an existing model directory (default: make --preset once)")
    parser.add_argument("--preset", default="qwen3-0.6b", help="make_model preset when --model is not given")
    parser.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"],
                        help="where make_model draws the random weights (cuda: seconds for an 8B model)")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "minivllm-bench-models"),
                        help="where the random-weight checkpoint is made and reused")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="prompt and output lengths: uniform in [min, max]")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=None, help="every prompt this long instead")
    parser.add_argument("--output-len", type=int, default=None, help="every output this long instead")
    parser.add_argument("--max-token-id", type=int, default=10000,
                        help="prompt ids uniform in [0, this] (capped at vocab_size - 1)")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="minivllm sampling temperature (nano-vllm's bench uses 0.6; 0 = greedy)")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="minivllm: return this many top logprobs per token (default: none, the plain path)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="minivllm: repetition_penalty of every request (1 = off, the plain path)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks (GPUs) that split the model (tensor_parallel_size)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (no CUDA graphs)")
    parser.add_argument("--max-prompt-graph-tokens", type=int, default=None,
                        help="the engine's max_prompt_graph_tokens (0: prompt steps eager; default: the engine's)")
    parser.add_argument("--no-async", action="store_true", help="async_scheduling=False (sync every step)")
    parser.add_argument("--no-compile", action="store_true", help="compile_small_ops=False (eager small ops)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="minivllm's KV cache (auto: the model's dtype; fp8: 1 byte per element, its own floor)")
    parser.add_argument("--quantization", default="none", choices=["none", "fp8"],
                        help="fp8: the linear weights quantized to FP8 at load time (W8A8, torch._scaled_mm)")
    parser.add_argument("--fp8-checkpoint", action="store_true",
                        help="run --preset's block-FP8 checkpoint (made by make_model: 128 x 128 weight scales, "
                             "the Triton block-scaled GEMM)")
    parser.add_argument("--compare-unquantized", action="store_true",
                        help="also run the model's dtype (cache and weights), same workload and run; prints the ratio")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="FP8 KV: scales from the first prefill instead of 1.0")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="enable_chunked_prefill=False (a step is a whole-prompt prefill or a decode)")
    parser.add_argument("--compare-chunked-prefill", action="store_true",
                        help="also run minivllm with the other chunked-prefill setting, in the same run")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step (default: the engine's)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers peer")
    common.add_engine_args(parser, "minivllm's runs")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: no checkpoint; the engine draws random weights on the device (needs --skip-hf; "
                             "for shapes too large to write, e.g. --preset qwen3-30b-a3b)")
    parser.add_argument("--hf-batch", type=int, default=256, help="static batch size of the HF peer")
    parser.add_argument("--hf-requests", type=int, default=None,
                        help="run HF on the first N requests only (its rate is the subset's, not extrapolated)")
    return common.add_common_args(parser)


TINY = dict(num_requests=4, min_len=8, max_len=16, preset="qwen3-tiny", max_model_len=128,
            copy_bytes=16 * 2**20)  # a CPU-sized workload: a tiny model, 4 short requests, both engines


def main(argv=None):
    run = common.start_run(build_parser(), argv, TINY)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    if args.compare_unquantized and not is_quantized(args):
        raise SystemExit("--compare-unquantized needs an FP8 setting to compare: --kv-cache-dtype fp8, "
                         "--quantization fp8 or --fp8-checkpoint")
    if args.fp8_checkpoint and (args.model or args.quantization != "none"):
        raise SystemExit("--fp8-checkpoint makes --preset's block-FP8 checkpoint: leave out --model and --quantization")
    if args.load_format == "dummy" and not args.skip_hf:
        raise SystemExit("--load-format dummy writes no weights for transformers to read: add --skip-hf")
    if args.load_format == "dummy" and args.fp8_checkpoint:
        raise SystemExit("--load-format dummy has no checkpoint to quantize: use --quantization fp8 instead")
    print(f"{NAME}: {env['device']}, torch {env['torch']}, transformers {env['transformers']}, {args.dtype}",
          flush=True)
    copy = common.measure_copy_bandwidth(args.copy_bytes or 2**30)
    matmul = common.measure_matmul_rate(8192 if on_cuda else 512, dtype)
    print(f"  copy {common.fmt(copy['TBps'])} TB/s, matmul {common.fmt(matmul['TFLOPs'])} TFLOP/s", flush=True)
    base_dir = model_dir_for(args)
    model_dir = model_dir_for(args, "fp8") if args.fp8_checkpoint else base_dir
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_token_id = min(args.max_token_id, vocab_size - 1)
    prompts, output_lens = make_workload(args.num_requests, args.min_len, args.max_len, max_token_id, args.seed,
                                         args.input_len, args.output_len)

    def floor_of(run_args):
        return roofline_floor(base_dir, prompts, output_lens, args.max_num_seqs, torch.finfo(dtype).bits // 8,
                              copy["TBps"], matmul["TFLOPs"],
                              kv_itemsize=1 if run_args.kv_cache_dtype == "fp8" else None,
                              layer_weight_itemsize=1 if run_args.quantization == "fp8" or run_args.fp8_checkpoint
                              else None)

    floor = floor_of(args)
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args),
               "model_dir": str(model_dir), "ceilings": {"copy": copy, "matmul": matmul},
               "workload": {"procedure": WORKLOAD_PROCEDURE, "max_token_id": max_token_id,
                            "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                            "output_tokens": sum(output_lens)},
               "floor": floor, "floor_formula": roofline_floor.__doc__}
    print(f"  workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt + {sum(output_lens)} output "
          f"tokens; floor {floor['seconds']:.3g} s", flush=True)
    payload["minivllm"] = _guarded(run_minivllm, model_dir, prompts, output_lens, args,
                                   False if args.no_chunked_prefill else None)
    if args.compare_chunked_prefill:  # the same workload with chunked prefill flipped from what the first run used
        payload["minivllm_other_chunking"] = _guarded(run_minivllm, model_dir, prompts, output_lens, args,
                                                      other_chunking(payload["minivllm"]))
    if args.compare_unquantized:  # the same workload on the model's dtype (cache and weights), same run
        baseline = unquantized(args)
        payload["floor_unquantized"] = floor_of(baseline)
        payload["minivllm_unquantized"] = _guarded(run_minivllm, base_dir, prompts, output_lens, baseline,
                                                   False if args.no_chunked_prefill else None)
    if not args.skip_hf:
        n = args.hf_requests or len(prompts)
        payload["hf"] = _guarded(run_hf, base_dir, prompts[:n], output_lens[:n], args, dtype, device)
        payload["hf"]["subset"] = f"first {n} of {len(prompts)} requests" if n < len(prompts) else "all requests"
    _summarise(payload)
    common.write_json(args.out_dir, NAME, payload)
    plot(payload, args)
    print_summary(payload)
    return payload


def _guarded(fn, *args):
    """Run one engine; a failure is recorded (and printed) instead of losing the other's figures."""
    try:
        result = fn(*args)
        print(f"  {fn.__name__}: {result['seconds']:.2f} s, {result['output_tok_per_s']:,.1f} output tok/s", flush=True)
        return result
    except Exception as exc:
        print(f"  {fn.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
        _release_memory()
        return {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"[:600]}


def _summarise(payload):
    mini, hf, floor = payload["minivllm"], payload.get("hf", {}), payload["floor"]
    base = payload.get("minivllm_unquantized", {})
    for run, run_floor in ((mini, floor), (payload.get("minivllm_other_chunking", {}), floor),
                           (base, payload.get("floor_unquantized"))):
        if "seconds" in run:
            run["fraction_of_floor"] = run_floor["seconds"] / run["seconds"]
            run["output_tokens_match_requested"] = run["output_tokens"] == run["requested_output_tokens"]
    if "seconds" in mini:
        if "seconds" in hf:
            payload["ratio_minivllm_over_hf_output_tok_per_s"] = mini["output_tok_per_s"] / hf["output_tok_per_s"]
        if "seconds" in base:
            payload["ratio_quantized_over_unquantized_output_tok_per_s"] = \
                mini["output_tok_per_s"] / base["output_tok_per_s"]
    floor["output_tok_per_s_at_floor"] = payload["workload"]["output_tokens"] / floor["seconds"]


def plot(payload, args):
    floor = payload["floor"]
    series = {_engine_label(payload["minivllm"]): [payload["minivllm"].get("output_tok_per_s")],
              "transformers generate" + (" (subset)" if "first" in payload.get("hf", {}).get("subset", "") else ""):
                  [payload.get("hf", {}).get("output_tok_per_s")]}
    for key in ("minivllm_other_chunking", "minivllm_unquantized"):
        if key in payload:
            series[_engine_label(payload[key])] = [payload[key].get("output_tok_per_s")]
    env = payload["environment"]
    lengths = (f"{args.input_len or f'[{args.min_len}, {args.max_len}]'} in, "
               f"{args.output_len or f'[{args.min_len}, {args.max_len}]'} out")
    panel = {"title": f"{payload['workload']['num_requests']} requests, {lengths}: output tok/s",
             "categories": [Path(payload["model_dir"]).name], "series": series, "ylabel": "output tok/s",
             "hline": ("roofline floor", floor["output_tok_per_s_at_floor"])}
    common.plot_panels(args.out_dir / f"{NAME}.png", [panel],
                       f"{env['device']} | {args.dtype} | torch {env['torch']} transformers "
                       f"{env['transformers']} | {env['date_utc']}")


def _note(run):
    compiled = run.get("kernels_compiled_while_measuring")
    return run.get("subset", "") or (f"{compiled} Triton kernel variants compiled while timed" if compiled else "")


def print_summary(payload):
    floor = payload["floor"]
    rows = []
    for key in ("minivllm", "minivllm_other_chunking", "minivllm_unquantized", "hf"):
        r = payload.get(key)
        if r is None:
            continue
        name = "transformers generate" if key == "hf" else _engine_label(r)
        if "seconds" not in r:
            rows.append([name, "-", "-", "-", "-", "-", r["error"][:80]])
            continue
        run_floor = payload["floor_unquantized"] if key == "minivllm_unquantized" else floor
        rows.append([name, r["num_requests"], f"{r['seconds']:.2f}", common.fmt(r["output_tok_per_s"]),
                     common.fmt(r["total_tok_per_s"]), _pct(run_floor["seconds"] / r["seconds"]) if
                     r["num_requests"] == payload["workload"]["num_requests"] else "-", _note(r)])
    floors = [("roofline floor", floor)]
    if "floor_unquantized" in payload:
        floors = [("roofline floor (FP8)", floor), ("roofline floor (unquantized)", payload["floor_unquantized"])]
    for name, f in floors:
        rows.append([name, payload["workload"]["num_requests"], f"{f['seconds']:.2f}",
                     common.fmt(payload["workload"]["output_tokens"] / f["seconds"]), "-", "100%",
                     f"KV {f['kv_seconds']:.2f} s + weights {f['weight_seconds']:.2f} s + "
                     f"prefill {f['prefill_seconds']:.2f} s"])
    ratio = payload.get("ratio_minivllm_over_hf_output_tok_per_s")
    quant_ratio = payload.get("ratio_quantized_over_unquantized_output_tok_per_s")
    common.print_table(["engine", "requests", "seconds", "output tok/s", "total tok/s", "of floor", "note"], rows,
                       title=f"End to end (copy {common.fmt(floor['copy_TBps'])} TB/s, matmul "
                             f"{common.fmt(floor['matmul_TFLOPs'])} TFLOP/s); minivllm / HF output tok/s = "
                             f"{common.fmt(ratio)}" + ("" if quant_ratio is None else
                             f"; FP8 / unquantized output tok/s = {common.fmt(quant_ratio)}"))


def _engine_label(result):
    """minivllm, with its chunked-prefill setting and any FP8 setting when the run recorded them."""
    engine = result.get("engine", {})
    chunked = engine.get("enable_chunked_prefill")
    parts = [] if chunked is None else [f"chunked prefill {'on' if chunked == 'True' else 'off'}"]
    if engine.get("kv_cache_torch_dtype", "").startswith("torch.float8"):
        parts.append("FP8 KV")
    weights = result.get("weights")
    if weights and weights != "unquantized":
        parts.append(f"{weights} weights")
    return "minivllm" + (f" ({', '.join(parts)})" if parts else "")


def _pct(fraction):
    return f"{100 * fraction:.0f}%"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
