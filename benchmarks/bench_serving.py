"""Online serving benchmark: an OpenAI-API load generator, like vLLM's `vllm bench serve`.

Random prompts of --input-len tokens ask for --output-len tokens each (ignore_eos), streamed;
requests arrive as a Poisson process at --request-rate per second (inf: all at once), at most
--max-concurrency in flight. Several rates run one after the other in one invocation. Reported per
rate: request and output-token throughput, TTFT / TPOT / ITL / E2E latency mean, median and p99.
Writes NAME.json and NAME.png (latency percentiles and throughput against request rate). With
--launch the server also records every engine step: per rate, a summary of where the engine's time
went (slowest steps, GPU idle between steps, time outside steps) is printed and kept in NAME.json,
and the steps themselves are written to NAME_steps.json.
vLLM: vllm/benchmarks/serve.py (same definitions of TTFT, TPOT and ITL).

    # against a running server (ours or any OpenAI-compatible one)
    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --request-rate 8 32 inf
    # start `minivllm serve MODEL_DIR` first, stop it after
    python -m benchmarks.bench_serving --launch MODEL_DIR --request-rate 8 32 inf --num-prompts 400

Needs aiohttp (pip install -e '.[serve]'); the server needs fastapi and uvicorn. Imports neither
torch nor the engine: it is a client.
"""
import argparse
import asyncio
import datetime
import importlib.metadata
import json
import math
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_out_dir() -> Path:
    """benchmarks/results (the recorded figures) on a machine with an NVIDIA GPU, benchmarks/results/cpu
    (ignored by git) elsewhere, as benchmarks.common does (this client does not import torch)."""
    try:
        on_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        on_gpu = False
    return RESULTS_DIR if on_gpu else RESULTS_DIR / "cpu"


NAME = "bench_serving"


# ----------------------------------------------------------------------------- workload

@dataclass
class Request:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int, tokenizer=None) -> list[Request]:
    """vLLM's random dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)], token ids
    uniform over the vocabulary. With a tokenizer the ids are decoded and the text is sent (the server
    tokenizes it, as for any client; the length is then what the server counts); without one the ids
    are sent as they are (exact lengths)."""
    rng = random.Random(seed)

    def length(n):
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        ids = [rng.randrange(vocab_size) for _ in range(length(input_len))]
        prompt = tokenizer.decode(ids) if tokenizer is not None else ids
        requests.append(Request(prompt, len(ids), length(output_len)))
    return requests


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process (exponential gaps
    of mean 1/rate), or all at 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, delays = 0.0, []
    for _ in range(num):
        delays.append(t)
        t += rng.expovariate(rate)
    return delays


# ----------------------------------------------------------------------------- one request

@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first streamed chunk
    latency: float = 0.0  # seconds to the last
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks


async def send_request(session, url: str, model: str, request: Request, args) -> RequestResult:
    """One streamed /v1/completions request, timed the way vLLM's benchmark times it."""
    payload = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
               "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
               "ignore_eos": args.ignore_eos}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = RequestResult(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk.get("error"):
                    result.error = str(chunk["error"])
                    return result
        result.latency = last - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no token was streamed"
    except Exception as e:  # noqa: BLE001 (a failed request is counted, not fatal)
        result.error = f"{type(e).__name__}: {e}"
    return result


# ----------------------------------------------------------------------------- one rate

async def run_rate(session, url, model, requests, rate, args) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    delays = arrival_delays(len(requests), rate, args.seed)
    start = time.perf_counter()

    async def one(request, delay):
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        if semaphore is None:
            return await send_request(session, url, model, request, args)
        async with semaphore:
            return await send_request(session, url, model, request, args)

    results = await asyncio.gather(*[one(r, d) for r, d in zip(requests, delays)])
    return list(results), time.perf_counter() - start


def _percentiles(values_s: list[float]) -> dict:
    """mean, median, p99 in milliseconds (linear interpolation, as numpy.percentile)."""
    if not values_s:
        return {"mean": None, "median": None, "p99": None}
    ms = sorted(v * 1000 for v in values_s)
    pos = 0.99 * (len(ms) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    p99 = ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": p99}


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]), "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]), "e2el_ms": _percentiles([r.latency for r in ok]),
    }


def print_summary(s: dict):
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}")]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        for stat in ("mean", "median", "p99"):
            value = s[key][stat]
            rows.append((f"{stat.capitalize()} {key.split('_')[0].upper()} (ms)", "-" if value is None else f"{value:.2f}"))
    print(f"{'=' * 20} Serving Benchmark Result (request rate {s['request_rate']}) {'=' * 20}")
    for name, value in rows:
        print(f"{name:<45}{value:>12}")
    for error in s["errors"]:
        print(f"error: {error}")


# ----------------------------------------------------------------------------- the sweep

async def fetch_model_name(session, base_url, api_key) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url + "/v1/models", headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"GET /v1/models answered {r.status}: {await r.text()}")
        return (await r.json())["data"][0]["id"]


def served_vocab_size(base_url: str, api_key: str | None, timeout: float = 30.0) -> int | None:
    """The vocabulary size a minivllm server lists in GET /v1/models (an extension of the OpenAI
    format, beside max_model_len); None from a server that does not list it or cannot be reached."""
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url + "/v1/models", headers=headers),
                                    timeout=timeout) as r:
            return json.loads(r.read())["data"][0].get("vocab_size")
    except (OSError, ValueError, KeyError, IndexError):
        return None


async def fetch_step_trace(session, base_url: str) -> list[dict] | None:
    """The launched server's engine steps since the last fetch (None if it keeps no trace)."""
    async with session.get(base_url + "/debug/step_trace") as r:
        if r.status != 200:
            return None
        return (await r.json())["steps"]


async def run_sweep(args, base_url: str, requests: list[Request], step_traces: list | None = None) -> list[dict]:
    """Every rate in turn. With `step_traces` (a list), the server's step trace of each rate is
    appended to it and summarized."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as session:
        model = args.model or await fetch_model_name(session, base_url, args.api_key)
        url = base_url + "/v1/completions"
        print(f"model {model!r} at {url}; one test request first", flush=True)
        test = await send_request(session, url, model, Request(requests[0].prompt, requests[0].prompt_len, 4), args)
        if not test.success:
            raise RuntimeError(f"the test request failed: {test.error}")
        summaries = []
        for rate in args.request_rate:
            print(f"request rate {rate}: {len(requests)} requests, max concurrency "
                  f"{args.max_concurrency or 'unlimited'}", flush=True)
            if step_traces is not None:
                await fetch_step_trace(session, base_url)  # drop the steps before this rate
            results, duration = await run_rate(session, url, model, requests, rate, args)
            summary = summarize(results, duration, rate)
            summary["max_concurrency"] = args.max_concurrency
            print_summary(summary)
            if step_traces is not None:
                steps = await fetch_step_trace(session, base_url)
                step_traces.append({"request_rate": summary["request_rate"], "steps": steps})
                if steps is not None:
                    from minivllm.engine.step_trace import summarize as summarize_steps

                    summary["step_trace"] = summarize_steps(steps)
                    print(summary["step_trace"])
            summaries.append(summary)
        return summaries


def offline_reference(model_dir: str, server_args: str, requests: list[Request], args) -> dict:
    """The same requests through `LLM.generate` in this process, with the server's engine flags: the
    engine's own throughput on the workload, so that served / offline shows what serving costs
    (HTTP, streaming, the event loop sharing the GIL with the engine thread)."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.engine_core import CoreOptions, prepare_engine
    from minivllm.entrypoints.openai.api_server import engine_kwargs, make_arg_parser

    options = engine_kwargs(make_arg_parser().parse_args([model_dir, *shlex.split(server_args)]))
    params = [SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=args.ignore_eos)
              for r in requests]
    with LLM(model_dir, **options) as llm:
        llm.generate([requests[0].prompt], SamplingParams(max_tokens=4), use_tqdm=False)
        prepare_engine(llm, CoreOptions(warm_up=True, step_trace=args.step_trace))  # the server's warm-up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
        duration = time.perf_counter() - start
        steps = llm.step_trace.take() if llm.step_trace is not None else None
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"duration_s": duration, "total_output_tokens": num_tokens, "output_throughput": num_tokens / duration,
              "engine_options": options}
    if steps:
        from minivllm.engine.step_trace import summarize as summarize_steps

        result["step_trace"] = summarize_steps(steps)
        print("offline " + result["step_trace"])
    return result


def plot(path: Path, summaries: list[dict], title: str):
    """Latency percentiles and throughput against request rate. Never raises (the JSON has it all)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped {path}")
        return
    labels = [str(s["request_rate"]) for s in summaries]
    x = range(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("TTFT (ms)", [("ttft_ms", "median"), ("ttft_ms", "p99")]),
              ("TPOT and ITL (ms)", [("tpot_ms", "mean"), ("tpot_ms", "p99"), ("itl_ms", "p99")])]
    for ax, (ylabel, series) in zip(axes, panels):
        for key, stat in series:
            ax.plot(x, [s[key][stat] if s[key][stat] is not None else float("nan") for s in summaries], marker="o",
                    label=f"{key.split('_')[0].upper()} {stat}")
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
    axes[2].bar(x, [s["output_throughput"] for s in summaries])
    axes[2].set_ylabel("output tokens / s")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("aiohttp", "minivllm"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def _rate(text: str) -> float:
    value = float(text)  # "inf" parses
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="an OpenAI-compatible server")
    target.add_argument("--launch", metavar="MODEL_DIR", help="start `minivllm serve MODEL_DIR` for the run")
    p.add_argument("--server-args", default="", help="flags for the launched server, one string "
                   "(e.g. \"--max-num-seqs 256 --gpu-memory-utilization 0.9\")")
    p.add_argument("--model", default=None, help="model name in the requests (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="send text: random ids decoded with this tokenizer "
                   "(default with --launch: none, token ids are sent)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=1024)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the tokenizer's size, the launched "
                   "model's vocab_size, the vocab_size a minivllm server lists in /v1/models, else 10000)")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[float("inf")],
                   help="one or more rates (req/s) run in turn; inf sends every request at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-reference", action="store_true",
                   help="with --launch: after the server stops, run the same requests through LLM.generate "
                   "(same engine flags) and report served / offline throughput")
    p.add_argument("--step-trace", action=argparse.BooleanOptionalAction, default=True,
                   help="with --launch: the server records every engine step; per rate, print a summary "
                   "(slowest steps, device idle, time outside steps) and write NAME_steps.json")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default: benchmarks/results on a GPU machine, benchmarks/results/cpu elsewhere")
    p.add_argument("--name", default=NAME, help="result file name (NAME.json, NAME.png)")
    return p


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.offline_reference and not args.launch:
        parser.error("--offline-reference needs --launch MODEL_DIR")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    vocab_size = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if vocab_size is None and args.launch:
        vocab_size = json.loads((Path(args.launch) / "config.json").read_text())["vocab_size"]
    if vocab_size is None:
        vocab_size = served_vocab_size(args.base_url.rstrip("/"), args.api_key)
    if vocab_size is None:
        vocab_size = 10000
        print("the server does not say its vocabulary size: random prompt ids below 10000 "
              "(--vocab-size or --tokenizer to choose)", flush=True)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                               vocab_size, args.seed, tokenizer)
    server, startup_seconds = None, None
    if args.launch:
        from minivllm.entrypoints.openai.server_process import ServerProcess

        server_args = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
        if args.step_trace and "--step-trace" not in server_args:
            server_args.append("--step-trace")
        print(f"starting minivllm serve {args.launch} {' '.join(server_args)}", flush=True)
        server = ServerProcess(args.launch, server_args, startup_timeout=600).start()
        startup_seconds = server.startup_seconds
        print(f"server healthy at {server.url} after {startup_seconds:.1f} s; its start-up log:", flush=True)
        print("\n".join("    " + line for line in server.log_tail().splitlines()), flush=True)
    try:
        base_url = server.url if server else args.base_url.rstrip("/")
        step_traces = [] if args.step_trace else None  # (a server without a trace answers 404: none kept)
        summaries = asyncio.run(run_sweep(args, base_url, requests, step_traces))
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped (exit code {code})")
    offline = None
    if args.offline_reference:
        print("offline reference: the same requests through LLM.generate", flush=True)
        offline = offline_reference(args.launch, args.server_args, requests, args)
        best = max(s["output_throughput"] for s in summaries)
        offline["served_over_offline"] = best / offline["output_throughput"]
        print(f"offline {offline['output_throughput']:,.0f} output tok/s; the best served rate reached "
              f"{offline['served_over_offline']:.2f}x of it")
    args.out_dir = args.out_dir or default_out_dir()
    payload = {
        "benchmark": NAME,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "options": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "request_rate": [str(r) for r in args.request_rate]},
        "environment": _versions(),
        "server_startup_seconds": startup_seconds,
        "results": summaries,
        "offline_reference": offline,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    if step_traces:
        steps_path = args.out_dir / f"{args.name}_steps.json"
        steps_path.write_text(json.dumps(step_traces) + "\n")
        print(f"wrote {steps_path} (every engine step of every rate)")
    target = args.launch or args.base_url
    plot(args.out_dir / f"{args.name}.png", summaries,
         f"{target}: {args.num_prompts} prompts, input {args.input_len} / output {args.output_len} tokens")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
