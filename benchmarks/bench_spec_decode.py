"""Speculative decoding (n-gram prompt lookup) against plain decoding, in one run: output tok/s per
batch size, the ratio, the acceptance length, and greedy outputs checked token for token.

    SPEC workload   per request a 64-token random segment (ids < 10000, random.Random(1)) repeated
                    4 times as the prompt, 256 output tokens, greedy, ignore_eos; B requests at once
    configs         "none" (no speculation), "ngram k=K" for each --ks (lookup --lookup-min..max),
                    every batch size drafting (disable_by_batch_size None: where is the break-even?),
                    and the engine's default rule ("ngram k=K default"), which stops drafting above
                    its disable_by_batch_size
    --smollm2       also SmolLM2-135M-Instruct (real weights) on COPY_TASKS, a copy-heavy set of 24
                    chat prompts, batch 1 (one request at a time): tok/s, acceptance, identical text
    --sampler       also the torch rejection sampler alone, per batch size (one-hot drafts, draft
                    probabilities, greedy), beside the verify step's device time: does it need a kernel?
    --draft-model   also the draft-model proposer, k = --ks[0], the engine's default rule: the target
                    as its own draft ("draft=target": every draft accepted, so its ratio is the
                    machinery's cost per accepted token) and the target's first --draft-layers layers
                    as the draft ("draft N-layer": a small draft of the same shape)
    --profile-kernels  per config at the first batch size, the GPU kernels of 10 steps after the
                    prefills (torch profiler): what a verify step runs that a plain step does not

Every config is warmed up at every batch size (a short run) before it is timed, so no timed run
pays a first compilation of kernels for a new number of rows.

vLLM: benchmarks/benchmark_throughput.py with --speculative-config (the same workload's figures,
measured on the same card, are in benchmarks/README.md).

    python -m benchmarks.bench_spec_decode [--batches 1 8 64] [--ks 4 2] [--smollm2]
    python -m benchmarks.bench_spec_decode --tiny      # CPU, seconds
    python -m benchmarks.bench_spec_decode --replot results/X.json   # redraw a recorded run's plot
"""
import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

from benchmarks import common

NAME = "bench_spec_decode"
TRACE_NOTE = "means; a step's host ms spans its scheduling to its postprocessing, one step ahead without drafts"
SMOKE = dict(preset="qwen3-tiny", batches=[1, 2], segment_len=8, output_len=12, ks=[2], draft_layers=1)

PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the members agreed "
           "to fund the new library, delay the road repairs until spring, and ask the city for a report on "
           "water quality before the next meeting.")
CODE = ("def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n")
LIST = "1. apples\n2. bread\n3. cheese\n4. dates\n5. eggs\n6. flour\n7. grapes\n"
QUOTES = ('She said "the train leaves at nine" and then added "bring your ticket". Later he wrote '
          '"the station is closed on Sundays" in his notes.')
COPY_TASKS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Copy this text exactly as it is:\n\n{PASSAGE}",
    f"Rewrite the passage below, replacing 'Tuesday' with 'Friday' and changing nothing else:\n\n{PASSAGE}",
    f"Rewrite the passage below in capital letters:\n\n{PASSAGE}",
    f"Repeat this paragraph twice:\n\n{PASSAGE}",
    f"Here is a passage. Write it again, then write it once more.\n\n{PASSAGE}",
    f"Repeat the following Python code exactly:\n\n{CODE}",
    f"Copy this function and rename it to merge_sorted:\n\n{CODE}",
    f"Rewrite this code with the variable 'out' renamed to 'result':\n\n{CODE}",
    f"Add a docstring to this function and repeat the rest unchanged:\n\n{CODE}",
    f"Write this code again with type hints added:\n\n{CODE}",
    f"Copy the following code block:\n\n```python\n{CODE}```",
    f"Continue this list up to 12 items, repeating the existing items first:\n\n{LIST}",
    f"Repeat this shopping list exactly:\n\n{LIST}",
    f"Rewrite this list with each item in capital letters:\n\n{LIST}",
    f"Number this list again starting from 10:\n\n{LIST}",
    f"Extract every quoted phrase from the text below, one per line:\n\n{QUOTES}",
    f"List the exact words inside the quotation marks:\n\n{QUOTES}",
    f"Repeat the text below, then list its quotes:\n\n{QUOTES}",
    f"Copy this sentence exactly: {QUOTES}",
    f"Repeat the following lines exactly:\n\n{LIST}{PASSAGE}",
    f"Write the passage again and then the list:\n\n{PASSAGE}\n\n{LIST}",
    f"Repeat the code and then the list below it:\n\n{CODE}\n{LIST}",
    f"Quote the first sentence of this passage three times:\n\n{PASSAGE}",
]


def parse_args(argv=None):
    parser = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--model", default=None, help="a model directory (default: a random --preset checkpoint)")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--segment-len", type=int, default=64)
    parser.add_argument("--repeats-in-prompt", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 2], help="draft lengths to measure")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct on the copy-heavy set")
    parser.add_argument("--smollm2-output-len", type=int, default=256)
    parser.add_argument("--smollm2-only", action="store_true", help="only the SmolLM2 part (no random-model workload)")
    parser.add_argument("--trace", action="store_true",
                        help="step trace per config: device and host ms of the steps with drafts (verify) and without")
    parser.add_argument("--profile-kernels", action="store_true",
                        help="per config, at the first batch size: the GPU kernels of PROFILE_STEPS steps after the "
                             "prefills (torch profiler), time per step by category and the top kernels")
    common.add_engine_args(parser, "every engine")
    parser.add_argument("--draft-model", action="store_true", help="also the draft-model proposer (see above)")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the small draft (the target's first)")
    parser.add_argument("--sampler", action="store_true",
                        help="also time the torch rejection sampler alone per batch (k = --ks[0], the model's vocabulary)")
    return common.start_run(parser, argv, SMOKE)


def spec_prompts(num: int, segment_len: int, repeats: int, vocab_size: int) -> list[dict]:
    rng = random.Random(1)
    vocab = min(10000, vocab_size)  # (a tiny test model has fewer ids)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(segment_len)] * repeats} for _ in range(num)]


def spec_config(k: int, args, disable_by_batch_size="default") -> dict | None:
    if k == 0:
        return None
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.lookup_min,
              "prompt_lookup_max": args.lookup_max}
    if disable_by_batch_size != "default":
        config["disable_by_batch_size"] = disable_by_batch_size
    return config


def timed_generate(llm, prompts, params) -> tuple[list, float, dict]:
    """(outputs, seconds, spec counters of this call) for one batch of prompts."""
    before = _spec_counts(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = _spec_counts(llm)
    return outputs, seconds, {name: after[name] - before[name] for name in after}


def _spec_counts(llm) -> dict:
    metrics = {m.name: m for m in llm.get_metrics()}
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {name: metrics[f"vllm:spec_decode_{name}"].value if f"vllm:spec_decode_{name}" in metrics else 0
            for name in names}


def acceptance_length(counts: dict) -> float | None:
    """Tokens per verified sequence-step (1 + accepted drafts per draft); None without drafts."""
    return 1 + counts["num_accepted_tokens"] / counts["num_drafts"] if counts["num_drafts"] else None


def agreement(token_ids: list, reference: list) -> float:
    """Mean fraction of each output that equals the reference before the first difference (bf16
    kernels at other batch shapes may flip a near-tie: greedy outputs then part ways)."""
    def common(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(b), 1)
    return sum(common(a, b) for a, b in zip(token_ids, reference)) / max(len(reference), 1)


def step_kind(record: dict) -> str:
    """A decode step with drafts is a verify step; the others keep the trace's kind."""
    return "verify" if record["kind"] == "decode" and record["num_drafted_seqs"] else record["kind"]


def trace_summary(llm, records: list[dict] | None = None) -> dict:
    """Device ms, host ms and the proposer's host ms per step kind (step_kind) since the trace started
    (means), and the steps per kind. records: the trace's records taken earlier (default: take them now)."""
    if records is None:
        records = llm.step_trace.take() if llm.step_trace is not None else []
    summary = {}
    for kind in sorted({step_kind(r) for r in records}):
        rows = [r for r in records if step_kind(r) == kind]
        device = [r["device_ms"] for r in rows if r["device_ms"] is not None]
        summary[kind] = {"steps": len(rows), "tokens_per_step": sum(r["num_tokens"] for r in rows) / len(rows),
                         "host_ms": sum(r["host_ms"] for r in rows) / len(rows),
                         "propose_ms": sum(r["propose_ms"] for r in rows) / len(rows),  # inside host_ms
                         "device_ms": sum(device) / len(device) if device else None,
                         "steps_with_drafts": sum(1 for r in rows if r["num_drafted_seqs"]),
                         "acceptance_length": (1 + sum(r["num_accepted_tokens"] for r in rows)
                                               / max(1, sum(r["num_drafted_seqs"] for r in rows)))}
    return summary


PROFILE_STEPS = 10


def profile_steps(llm, prompts, params) -> dict:
    """The GPU kernels of PROFILE_STEPS engine steps once the prompts are prefilled (profile_decode's
    kernel_profile): ms per step by category, their sum, and the top kernels with calls per step; and
    the forwards those engine steps collected, by step_kind (an engine step that only schedules, or
    collects a step launched before, runs none: per-step figures are over all PROFILE_STEPS). The
    requests are then aborted."""
    from benchmarks.profile_decode import kernel_profile

    for prompt in prompts:
        llm.add_request(prompt, params)
    while llm.scheduler.waiting or any(seq.is_prefilling for seq in llm.scheduler.running):
        llm.step()
    llm.start_step_trace()
    totals, top = kernel_profile(llm, PROFILE_STEPS)
    forwards = collections.Counter(step_kind(r) for r in llm.step_trace.take())
    llm.step_trace = None
    llm.abort_all()
    return {"steps": PROFILE_STEPS, "forwards": dict(forwards), "kernels_ms": totals,
            "kernels_sum_ms": sum(totals.values()), "kernels_per_step": sum(n for _, _, n in top), "top": top}


def time_sampler(batches, k: int, vocab: int) -> dict:
    """{batch: ms per rejection_sample call} for one-hot (n-gram) drafts, a draft model's probabilities
    and greedy rows; eager calls, as the engine makes them after the verify forward."""
    import torch

    from minivllm.engine.rejection_sampler import rejection_sample

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    figures = {}
    for batch in batches:
        probs = torch.softmax(torch.randn(batch, k + 1, vocab, device=device), dim=-1)
        draft_probs = torch.softmax(torch.randn(batch, k, vocab, device=device), dim=-1)
        drafts = torch.randint(0, vocab, (batch, k), device=device)
        num_drafts = torch.full((batch,), k, device=device)
        greedy = torch.ones(batch, dtype=torch.bool, device=device)
        cases = {"one_hot_ms": dict(), "draft_probs_ms": dict(draft_probs=draft_probs),
                 "greedy_ms": dict(is_greedy=greedy)}
        figures[batch] = {name: common.bench_ms(
            lambda extra=extra: rejection_sample(probs, drafts, num_drafts, generator=generator, **extra), [()])
            for name, extra in cases.items()}
    return figures


def draft_configs(model, args) -> list[tuple[str, dict]]:
    """The draft-model configs of --draft-model: the target as its own draft, and its first layers."""
    k = args.ks[0]
    small = draft_dir(model, args.draft_layers)
    return [(f"draft=target k={k}", {"method": "draft_model", "model": model, "num_speculative_tokens": k}),
            (f"draft {args.draft_layers}-layer k={k}", {"method": "draft_model", "model": str(small),
                                                        "num_speculative_tokens": k})]


SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "make_model.json")


def draft_dir(model, num_layers: int):
    """A checkpoint of the target's first `num_layers` layers (embeddings, final norm and LM head kept),
    written once beside the target: a draft of the same shape that shares its tokenizer."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    source, out = Path(model), Path(f"{model.rstrip('/')}-first{num_layers}")
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(exist_ok=True)
    for path in source.iterdir():  # the tokenizer's files and the generation config
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in SKIPPED_FILES:
            shutil.copy(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # one entry per layer
        config["layer_types"] = config["layer_types"][:num_layers]
    if isinstance(config.get("mlp_only_layers"), list):  # layer indices
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
            if layer is None or int(layer) < num_layers:
                tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    return out


def run_spec_workload(model, args, run) -> tuple[dict, dict]:
    """{config: {batch: figures}} and the greedy outputs of "none" for the identity check."""
    from minivllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm_up = SamplingParams(temperature=0.0, max_tokens=min(16, args.output_len), ignore_eos=True)
    max_len = args.segment_len * args.repeats_in_prompt + args.output_len + 16
    configs = [("none", None)] + [(f"ngram k={k}", spec_config(k, args, None)) for k in args.ks]
    configs += [(f"ngram k={args.ks[0]} prefill-verify", {**spec_config(args.ks[0], args, None), "verify": "prefill"})]
    configs += [(f"ngram k={args.ks[0]} default", spec_config(args.ks[0], args))]
    if args.draft_model:
        configs += draft_configs(model, args)
    results, reference = {}, {}
    for name, config in configs:
        llm = LLM(model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=max(args.batches),
                  speculative_config=config, **args.engine_args)
        vocab_size = llm.config.hf_config.vocab_size
        for batch in args.batches:  # warm-up: every row count the timed runs will step with
            timed_generate(llm, spec_prompts(batch, args.segment_len, args.repeats_in_prompt, vocab_size), warm_up)
        results[name] = {}
        for batch in args.batches:
            prompts = spec_prompts(batch, args.segment_len, args.repeats_in_prompt, vocab_size)
            if args.trace:
                llm.start_step_trace()
            outputs, seconds, counts = timed_generate(llm, prompts, params)
            token_ids = [o.outputs[0].token_ids for o in outputs]
            if name == "none":
                reference[batch] = token_ids
            num_tokens = sum(len(t) for t in token_ids)
            results[name][batch] = {"output_tok_s": num_tokens / seconds, "seconds": seconds, "tokens": num_tokens,
                                    "acceptance_length": acceptance_length(counts), **counts,
                                    "same_tokens_as_none": token_ids == reference[batch],
                                    "agreement": agreement(token_ids, reference[batch])}
            if args.trace:
                results[name][batch]["trace"] = trace_summary(llm)
                llm.step_trace = None
            if args.profile_kernels and batch == args.batches[0]:
                results[name][batch]["kernels"] = profile_steps(llm, prompts, params)
        llm.shutdown()
    return results, reference


def run_smollm2(args) -> dict:
    """SmolLM2 on the copy-heavy chat prompts, batch 1: no speculation, then n-gram k = ks[0]."""
    from minivllm import LLM, SamplingParams
    from minivllm.tools.smollm2 import get_smollm2

    model = str(get_smollm2())
    params = SamplingParams(temperature=0.0, max_tokens=args.smollm2_output_len)
    figures, texts, token_ids = {}, {}, {}
    for name, config in (("none", None), (f"ngram k={args.ks[0]}", spec_config(args.ks[0], args))):
        llm = LLM(model, dtype=args.dtype, max_model_len=2048, speculative_config=config, **args.engine_args)
        prompts = [llm.get_tokenizer().apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                                           add_generation_prompt=True) for task in COPY_TASKS]
        timed_generate(llm, prompts[:1], params)  # warm-up
        seconds, outs, totals = 0.0, [], {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        records = []
        for prompt in prompts:  # batch 1: one request at a time
            if args.trace:
                llm.start_step_trace()
            outputs, s, counts = timed_generate(llm, [prompt], params)
            if args.trace:
                records += llm.step_trace.take()
            seconds += s
            outs.append(outputs[0].outputs[0])
            totals = {key: totals[key] + counts[key] for key in totals}
        texts[name] = [o.text for o in outs]
        token_ids[name] = [o.token_ids for o in outs]
        num_tokens = sum(len(o.token_ids) for o in outs)
        figures[name] = {"output_tok_s": num_tokens / seconds, "seconds": seconds, "tokens": num_tokens,
                         "acceptance_length": acceptance_length(totals), **totals}
        if args.trace:
            figures[name]["trace"] = trace_summary(llm, records)
            llm.step_trace = None
        llm.shutdown()
    spec_name = f"ngram k={args.ks[0]}"
    figures[spec_name]["same_text_as_none"] = texts[spec_name] == texts["none"]
    figures[spec_name]["prompts_with_same_text"] = sum(a == b for a, b in zip(texts[spec_name], texts["none"]))
    figures[spec_name]["agreement"] = agreement(token_ids[spec_name], token_ids["none"])
    figures[spec_name]["speedup"] = figures[spec_name]["output_tok_s"] / figures["none"]["output_tok_s"]
    figures["examples"] = texts["none"][:3]
    return figures


def main(argv=None):
    run = parse_args(argv)
    args = run.args
    payload = {"benchmark": NAME, "environment": run.env, "options": common.options_dict(args)}
    if args.smollm2_only:
        payload["smollm2"] = run_smollm2(args)
        common.write_json(args.out_dir, NAME, payload)
        print_smollm2(payload["smollm2"], args)
        return payload
    model = args.model or str(_model_dir(args))
    results, _ = run_spec_workload(model, args, run)
    payload["spec"] = results
    if args.smollm2:
        payload["smollm2"] = run_smollm2(args)
    if args.sampler:
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model).vocab_size
        payload["sampler"] = time_sampler(args.batches, args.ks[0], vocab)
    common.write_json(args.out_dir, NAME, payload)
    none = results["none"]
    rows = []
    for name, by_batch in results.items():
        for batch, r in by_batch.items():
            accept = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
            rows.append([name, batch, f"{r['output_tok_s']:,.0f}", f"{r['output_tok_s'] / none[batch]['output_tok_s']:.2f}x",
                         accept, "yes" if r["same_tokens_as_none"] else f"{r['agreement']:.0%}"])
    common.print_table(["config", "batch", "output tok/s", "vs none", "accept len", "same tokens (agreement)"], rows,
                       title=f"{NAME}: {args.segment_len}-token segment x {args.repeats_in_prompt}, "
                             f"{args.output_len} output tokens, greedy")
    print_trace(results, f"the step trace ({TRACE_NOTE})")
    if args.profile_kernels:
        print_kernels(results)
    if args.smollm2:
        print_smollm2(payload["smollm2"], args)
    if args.sampler:
        verify = results.get(f"ngram k={args.ks[0]}", {})
        common.print_table(["batch", "one-hot ms", "draft probs ms", "greedy ms", "verify step device ms"], [
            [b, *(f"{f[c]:.3f}" for c in ("one_hot_ms", "draft_probs_ms", "greedy_ms")),
             common.fmt(verify.get(b, {}).get("trace", {}).get("verify", {}).get("device_ms"))]
            for b, f in payload["sampler"].items()], title=f"the torch rejection sampler alone, k={args.ks[0]}")
    plot(results, args.batches, args.out_dir / f"{NAME}.png")
    return payload


def print_trace(figures_by_config: dict, title: str):
    """The step trace's means per config and step kind: {config: {label: figures with a "trace"}}."""
    rows = [[name, label, kind, t["steps"], f"{t['tokens_per_step']:.2f}", common.fmt(t["device_ms"]),
             f"{t['host_ms']:.3f}", f"{t['propose_ms']:.3f}"]
            for name, by_label in figures_by_config.items() for label, figures in by_label.items()
            for kind, t in figures.get("trace", {}).items()]
    if rows:
        common.print_table(["config", "batch", "step", "steps", "tokens/step", "device ms", "host ms", "propose ms"],
                           rows, title=title)


def print_kernels(results: dict):
    """--profile-kernels: per config, the kernels' ms per step by category, then the top kernels."""
    profiled = {name: figures["kernels"] for name, by_batch in results.items() for figures in by_batch.values()
                if "kernels" in figures}
    categories = sorted({c for k in profiled.values() for c in k["kernels_ms"]})
    common.print_table(["config", "forwards collected", "kernels/step", "sum ms", *categories], [
        [name, " ".join(f"{n} {kind}" for kind, n in sorted(k["forwards"].items())) or "none", k["kernels_per_step"],
         common.fmt(k["kernels_sum_ms"]), *(common.fmt(k["kernels_ms"].get(c)) for c in categories)]
        for name, k in profiled.items()], title=f"GPU kernels per engine step, over {PROFILE_STEPS} engine steps after "
                                                "the prefills (and the forwards those steps collected)")
    for name, k in profiled.items():
        common.print_table(["kernel", "ms/step", "calls/step"], [[kernel, common.fmt(ms), n] for kernel, ms, n in k["top"][:8]],
                           title=f"{name}: top kernels")


def print_smollm2(s, args):
    spec_name = f"ngram k={args.ks[0]}"
    spec = s[spec_name]
    same = f"{spec['prompts_with_same_text']}/{len(COPY_TASKS)} prompts, agreement {spec['agreement']:.1%}"
    common.print_table(["config", "output tok/s", "accept len", "speedup", "same text"], [
        ["none", f"{s['none']['output_tok_s']:,.0f}", "-", "1.00x", "-"],
        [spec_name, f"{spec['output_tok_s']:,.0f}", f"{spec['acceptance_length'] or 1:.2f}", f"{spec['speedup']:.2f}x",
         same]], title=f"SmolLM2-135M-Instruct ({args.dtype}), {len(COPY_TASKS)} copy-heavy chat prompts, batch 1")
    print_trace({name: {1: s[name]} for name in ("none", spec_name)}, f"SmolLM2's step trace ({TRACE_NOTE})")


def plot(results, batches, path):
    """Speedup over no speculation and output tok/s per config, by batch size (results: payload["spec"])."""
    none = results["none"]
    common.plot_panels(path, [
        {"title": "speedup over no speculation by batch size (the break-even is where a bar crosses 1)",
         "categories": [f"batch {b}" for b in batches],
         "series": {name: [by_batch[b]["output_tok_s"] / none[b]["output_tok_s"] for b in batches]
                    for name, by_batch in results.items() if name != "none"},
         "ylabel": "x no speculation", "hline": ("no speculation", 1.0)},
        {"title": "output tok/s", "categories": [f"batch {b}" for b in batches],
         "series": {name: [by_batch[b]["output_tok_s"] for b in batches] for name, by_batch in results.items()},
         "ylabel": "tok/s"}])


def replot(json_path):
    """Redraw a recorded run's plot beside its JSON (same name, .png)."""
    results = json.loads(Path(json_path).read_text())["spec"]
    batches = sorted(results["none"], key=int)  # JSON keys: the batch sizes as strings
    plot(results, batches, Path(json_path).with_suffix(".png"))


def _model_dir(args):
    from minivllm.tools.make_model import make_model
    from minivllm.tools.tokenizer import minivllm_cache_dir

    return make_model(args.preset, minivllm_cache_dir() / f"random-{args.preset}", seed=0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replot"]:  # python -m benchmarks.bench_spec_decode --replot RESULT.json
        replot(sys.argv[2])
    else:
        main()
