"""The course's ladder: one workload through the engine's stages in order, each rung switching one
more idea on (cumulatively), output tok/s per rung and its ratio to chapter 00's naive loop.

    python -m benchmarks.bench_ladder                       # GPU: qwen3-0.6b, bench_throughput's 256 requests
    python -m benchmarks.bench_ladder --num-requests 64 --max-len 512
    python -m benchmarks.bench_ladder --cpu-smoke           # CPU: qwen3-tiny, a few requests, seconds

Every rung runs the same random-weight model on the same requests, greedy, ignore_eos, so each emits
exactly the tokens the requests ask for; the script checks the counts, and compares every engine
rung's tokens with rung 1's (and the baseline's). A rung that cannot run here is reported skipped
with its reason. vLLM has no such script; its benchmarks/benchmark_throughput.py measures one rung.
"""
import argparse
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field

from benchmarks import common
from benchmarks.bench_throughput import add_workload_args, make_workload, model_dir_for

NAME = "bench_ladder"


@dataclass(frozen=True)
class Rung:
    """One stage of the course: the engine options it adds to the rung before it (`adds`), the
    chapter that introduces them, and what it needs to run."""
    number: int
    name: str
    chapter: str
    adds: dict = field(default_factory=dict)
    needs_triton: bool = False  # the Triton kernels: a GPU, or the interpreter on --cpu-smoke's tiny shapes
    needs_cuda: bool = False    # only does something on a GPU (on a CPU its options change nothing)


# Rung 1 turns every later idea off explicitly, so that each rung after it is one argument.
CORE_OPTIONS = dict(attention_backend="torch", enforce_eager=True, enable_prefix_caching=False,
                    async_scheduling=False, enable_chunked_prefill=False, compile_small_ops=False)
RUNGS = (
    Rung(0, "naive loop (minivllm/baseline.py)", "00"),
    Rung(1, "core engine: paged KV cache + continuous batching, torch attention, eager", "02, 03", CORE_OPTIONS),
    Rung(2, "+ prefix caching", "04", dict(enable_prefix_caching=True)),
    Rung(3, "+ Triton attention kernels", "05, 06", dict(attention_backend="triton"), needs_triton=True),
    Rung(4, "+ CUDA graphs", "07", dict(enforce_eager=False), needs_triton=True, needs_cuda=True),
    Rung(5, "+ async scheduling", "07", dict(async_scheduling=True), needs_triton=True),
    Rung(6, "+ chunked prefill", "11", dict(enable_chunked_prefill=True), needs_triton=True),
    Rung(7, "+ fused small ops (the LLM(...) defaults)", "09", dict(compile_small_ops=True), needs_triton=True),
)
# The Config fields the rungs set; the last rung must equal what LLM(...) chooses by default on a GPU.
LADDER_FIELDS = tuple(CORE_OPTIONS)


def engine_options(number: int) -> dict:
    """The cumulative engine options of rung `number` (>= 1): rung 1's, then each later rung's `adds`."""
    if not 1 <= number < len(RUNGS):
        raise ValueError(f"engine rungs are 1..{len(RUNGS) - 1}, got {number}")
    options = {}
    for rung in RUNGS[1:number + 1]:
        options.update(rung.adds)
    return options


def skip_reason(rung: Rung, on_cuda: bool, cpu_smoke: bool) -> str | None:
    """Why `rung` does not run on this machine, or None when it does."""
    if on_cuda:
        return None
    if rung.needs_cuda:
        return "skipped: needs CUDA (on a CPU enforce_eager=False captures nothing)"
    if rung.needs_triton and not cpu_smoke:
        return "skipped: the Triton kernels run in the interpreter on a CPU, only with --cpu-smoke's tiny shapes"
    return None


def rung_note(rung: Rung, on_cuda: bool) -> str:
    """What a rung that runs here switches on beyond its name, or does not switch on (on a CPU)."""
    notes = []
    if rung.number == 3:
        notes.append("the Triton backend also fuses q/k-norm + RoPE + KV store (fused_ops.py)")
    if not on_cuda and rung.number > 4:
        notes.append("no CUDA graphs on CPU")
    if not on_cuda and rung.number == 7:
        notes.append("compile_small_ops acts on CUDA only: same engine as rung 6")
    return "; ".join(notes)


# ----------------------------------------------------------------------------- the rungs

def run_baseline(model_dir, prompts, output_lens, args, dtype, device):
    """Rung 0: static batches of --baseline-batch (default: all requests in one), left-padded, greedy."""
    from minivllm import baseline

    model, _ = baseline.load(str(model_dir), dtype=dtype, device=device)
    baseline.generate(model, prompts[:2], 2)  # warm-up
    batch = args.baseline_batch or len(prompts)
    common.sync()
    start = time.perf_counter()
    completions = []
    for i in range(0, len(prompts), batch):
        completions += baseline.generate(model, prompts[i:i + batch], output_lens[i:i + batch])
    common.sync()
    seconds = time.perf_counter() - start
    del model
    _release_memory()
    return {"seconds": seconds, "baseline_batch": batch}, completions


def run_engine(model_dir, prompts, output_lens, run, options):
    """One engine rung: build, warm up, time `generate`, record what the engine resolved, shut down."""
    from minivllm import LLM, SamplingParams

    args = run.args
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, **options)
    try:
        # On a GPU the warm-up compiles the Triton kernels' prefill and decode variants; the interpreter
        # compiles nothing, so on a CPU one short request (every interpreted step costs seconds) is enough.
        warmup = [[1 + i for i in range(8)], [2 + i for i in range(12)]] if run.on_cuda else [[1, 2, 3]]
        llm.generate(warmup, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4 if run.on_cuda else 1),
                     use_tqdm=False)
        kv = llm.scheduler.kv_cache_manager
        hits_before = kv.num_cached_tokens_hit
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
        common.sync()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        common.sync()
        seconds = time.perf_counter() - start
        result = {"seconds": seconds, "prefix_cache_hit_tokens": kv.num_cached_tokens_hit - hits_before,
                  "engine": {k: str(getattr(llm.config, k)) for k in ("device", "torch_dtype", *LADDER_FIELDS)},
                  "runner_layers": [c.__name__ for c in type(llm.model_runner).__mro__[1:]
                                    if c.__module__.startswith("minivllm.engine")],
                  "stepper": type(llm.engine_core.stepper).__name__}
        completions = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()
        del llm
        _release_memory()
    return result, completions


def _release_memory():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def defaults_check(model_dir, args, options):
    """Does the last rung's engine equal LLM(...)'s defaults on this device? {field: (rung, default)} where not."""
    from minivllm.config import Config

    default = Config(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len)
    differ = {k: [v, getattr(default, k)] for k, v in options.items() if getattr(default, k) != v}
    return {"equal": not differ, "differences (rung 7, default)": differ}


def climb(model_dir, prompts, output_lens, run, after_rung=lambda rows: None):
    """Every rung in order; a rung that raises is recorded as failed and the ladder goes on.
    after_rung(rows) runs after each rung (main writes the rows so far: a run cut short keeps them)."""
    args, rows, completions_of = run.args, [], {}
    for rung in RUNGS:
        if rows:
            after_rung(rows)
        row = {"rung": rung.number, "name": rung.name, "chapter": rung.chapter, "adds": rung.adds,
               "options": engine_options(rung.number) if rung.number else {}}
        reason = skip_reason(rung, run.on_cuda, args.cpu_smoke)
        if reason:
            rows.append({**row, "status": "skipped", "reason": reason})
            print(f"  rung {rung.number} ({rung.name}): {reason}", flush=True)
            continue
        try:
            if rung.number == 0:
                result, completions = run_baseline(model_dir, prompts, output_lens, args, run.dtype, run.device)
            else:
                result, completions = run_engine(model_dir, prompts, output_lens, run, row["options"])
        except Exception as exc:
            _release_memory()
            rows.append({**row, "status": "failed", "error": f"{type(exc).__name__}: {exc}"[:600]})
            print(f"  rung {rung.number} ({rung.name}) failed: {rows[-1]['error']}", flush=True)
            continue
        output_tokens = sum(map(len, completions))
        rows.append({**row, "status": "ok", "note": rung_note(rung, run.on_cuda), **result,
                     "output_tokens": output_tokens, "output_tok_per_s": output_tokens / result["seconds"]})
        completions_of[rung.number] = completions
        print(f"  rung {rung.number} ({rung.name}): {result['seconds']:.2f} s, "
              f"{rows[-1]['output_tok_per_s']:,.1f} output tok/s", flush=True)
    return rows, completions_of


def compare(rows, completions_of, output_lens):
    """Ratios to rung 0 and to the rung before; token counts against the requests; greedy tokens
    against rung 1's. Mismatches are recorded per rung, never dropped."""
    base = completions_of.get(0) and rows[0]["output_tok_per_s"]
    previous = None
    reference = completions_of.get(1)
    for row in rows:
        if row["status"] != "ok":
            continue
        row["ratio_to_baseline"] = row["output_tok_per_s"] / base if base else None
        row["ratio_to_previous"] = row["output_tok_per_s"] / previous if previous else None
        previous = row["output_tok_per_s"]
        completions = completions_of[row["rung"]]
        row["output_tokens_match_requested"] = [len(c) for c in completions] == list(output_lens)
        if reference is not None and row["rung"] != 1:
            different = [i for i, (a, b) in enumerate(zip(completions, reference)) if a != b]
            row["greedy_requests_equal_to_rung_1"] = f"{len(completions) - len(different)}/{len(completions)}"
            row["greedy_mismatched_requests"] = different
    engine_rows = [r for r in rows if r["status"] == "ok" and r["rung"] >= 2]
    return {"token_counts_equal": all(r["output_tokens_match_requested"] for r in rows if r["status"] == "ok"),
            "engine_greedy_outputs_equal": reference is not None
            and all(not r["greedy_mismatched_requests"] for r in engine_rows),
            "baseline_greedy_equal_to_rung_1": rows[0].get("greedy_requests_equal_to_rung_1")}


# ----------------------------------------------------------------------------- main

def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="prepend the same this many random ids to every prompt (default 0: bench_throughput's "
                             "prompts share no prefix, so prefix caching finds no hits)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="every engine rung's token budget per step (>= --max-model-len: rungs 1-5 "
                             "prefill a whole prompt in one step)")
    parser.add_argument("--baseline-batch", type=int, default=None,
                        help="rung 0's static batch size (default: every request in one batch)")
    return common.add_common_args(parser)


# --cpu-smoke: a tiny model and 3 short requests of 2 output tokens each (an interpreted Triton step costs
# one to two seconds); a budget of 32 tokens, below the prompts' total, so rung 6 splits a prompt across steps
TINY = dict(num_requests=3, min_len=8, max_len=16, output_len=2, preset="qwen3-tiny", max_model_len=32,
            max_num_batched_tokens=32, max_num_seqs=8)


def main(argv=None):
    run = common.start_run(build_parser(), argv, TINY)
    args, env = run.args, run.env
    print(f"{NAME}: {env['device']}, torch {env['torch']}, {args.dtype}", flush=True)
    model_dir = model_dir_for(args)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_token_id = min(args.max_token_id, vocab_size - 1)
    prompts, output_lens = make_workload(args.num_requests, args.min_len, args.max_len, max_token_id, args.seed,
                                         args.input_len, args.output_len)
    prefix_rng = random.Random(args.seed + 1)
    shared_prefix = [prefix_rng.randint(0, max_token_id) for _ in range(args.shared_prefix_len)]
    prompts = [shared_prefix + p for p in prompts]
    print(f"  workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt + {sum(output_lens)} output "
          f"tokens, greedy", flush=True)
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args),
               "model_dir": str(model_dir),
               "workload": {"procedure": "bench_throughput.make_workload, greedy, ignore_eos",
                            "max_token_id": max_token_id, "shared_prefix_len": args.shared_prefix_len,
                            "num_requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                            "output_tokens": sum(output_lens)}}

    def write_partial(rows):  # the rungs so far, unchecked, until the ladder is complete
        common.write_json(args.out_dir, NAME, {**payload, "complete": False, "rungs": rows})

    rows, completions_of = climb(model_dir, prompts, output_lens, run, write_partial)
    checks = compare(rows, completions_of, output_lens)
    checks["last_rung_equals_llm_defaults"] = defaults_check(model_dir, args, engine_options(len(RUNGS) - 1))
    payload.update(complete=True, rungs=rows, checks=checks)
    common.write_json(args.out_dir, NAME, payload)
    plot(payload, args)
    print_summary(payload)
    return not any(r["status"] == "failed" for r in rows)


def plot(payload, args):
    """Bars of output tok/s per rung, each labelled with its ratio to rung 0 (or why it did not run).
    Never raises: the JSON is already written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped {NAME}.png")
        return
    path = args.out_dir / f"{NAME}.png"
    try:
        rows = payload["rungs"]
        fig, ax = plt.subplots(figsize=(11, 4.8))
        heights = [r.get("output_tok_per_s") or 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), heights, color=["#888888"] + ["#3b75af"] * (len(rows) - 1))
        for bar, row in zip(bars, rows):
            ratio = row.get("ratio_to_baseline")
            text = f"{common.fmt(ratio)}x" if ratio else row["status"]
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{r['rung']}: {_short(r['name'])}\n(ch. {r['chapter']})" for r in rows], fontsize=7)
        ax.set_ylabel("output tok/s")
        work = payload["workload"]
        ax.set_title(f"The ladder: {work['num_requests']} requests, {work['output_tokens']} output tokens; "
                     f"each bar: output tok/s over rung 0's", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        env = payload["environment"]
        fig.suptitle(f"{env['device']} | {args.dtype} | torch {env['torch']} | {env['date_utc']}"
                     + ("" if env["cuda"] else " | CPU smoke: not a performance figure"), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
    except Exception as exc:
        print(f"note: plotting failed ({type(exc).__name__}: {exc}); the JSON has every figure")


def _short(name):
    return name.split(":")[0].split(" (")[0].removeprefix("+ ")


def print_summary(payload):
    rows = []
    for r in payload["rungs"]:
        if r["status"] != "ok":
            rows.append([r["rung"], r["chapter"], r["name"], "-", "-", "-", "-", r.get("reason") or r.get("error")])
            continue
        rows.append([r["rung"], r["chapter"], r["name"], f"{r['seconds']:.2f}", common.fmt(r["output_tok_per_s"]),
                     "-" if r["ratio_to_baseline"] is None else f"{common.fmt(r['ratio_to_baseline'])}x",
                     r.get("greedy_requests_equal_to_rung_1", "-"), r["note"]])
    checks = payload["checks"]
    defaults = checks["last_rung_equals_llm_defaults"]
    common.print_table(["rung", "chapter", "stage (cumulative)", "seconds", "output tok/s", "x rung 0",
                        "greedy = rung 1", "note"], rows,
                       title=f"The ladder ({payload['environment']['device']}"
                             + ("" if payload["environment"]["cuda"] else ", CPU: not a performance figure")
                             + f"): token counts equal: {checks['token_counts_equal']}; engine greedy outputs "
                               f"equal: {checks['engine_greedy_outputs_equal']}; rung 7 = LLM(...) defaults here: "
                               f"{defaults['equal'] or defaults['differences (rung 7, default)']}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
