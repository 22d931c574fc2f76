"""What every paired benchmark needs: device facts, ceilings measured in the same run, a timer
that rotates inputs, a correctness gate, SDPA backends, and JSON/table/plot output.

vLLM: benchmarks/kernels/utils.py; the timing follows the Triton tutorials' `triton.testing.do_bench`.
Nothing here imports triton at module level: a script must first call
`use_interpreter_without_cuda()` so that TRITON_INTERPRET is set before triton is imported.
"""
import argparse
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_out_dir() -> Path:
    """benchmarks/results (the recorded figures) on a GPU; benchmarks/results/cpu on a CPU, which git
    ignores, so that a CPU or --cpu-smoke run never overwrites the recorded GPU figures."""
    return RESULTS_DIR if torch.cuda.is_available() else RESULTS_DIR / "cpu"


H200_L2_BYTES = 50 * 1024**2  # fallback when the driver does not say
# Max |ours - reference| allowed before a provider is marked FAIL; the reference is float32
# softmax rounded to the input dtype, so bf16 rounding of P and O dominates.
ATOL = {torch.bfloat16: 4e-2, torch.float16: 5e-3, torch.float32: 5e-3}  # fp32: GPUs use tf32 dots
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


# ----------------------------------------------------------------------------- environment

def use_interpreter_without_cuda():
    """Without CUDA, run Triton kernels in the interpreter. Call before triton is imported.

    Returns whether CUDA is available."""
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    return on_cuda


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def l2_cache_bytes():
    if not torch.cuda.is_available():
        return None
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or H200_L2_BYTES


def environment():
    """Device and library versions, recorded in every JSON result."""
    import triton

    on_cuda = torch.cuda.is_available()
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_cuda else f"cpu ({platform.processor() or platform.machine()})",
        "cuda": on_cuda,
        "cuda_version": torch.version.cuda,
        "l2_cache_bytes": l2_cache_bytes(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "timer": "triton.testing.do_bench median (L2 flushed before each call)" if on_cuda
        else "host clock median of a few calls (CPU smoke: not a performance figure)",
    }
    if on_cuda:
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def compiled_kernel_variants() -> int | None:
    """How many compiled variants minivllm's Triton kernels hold in this process (None under the
    interpreter, which compiles nothing). Triton compiles a kernel once per set of constexpr values
    and per value class of its integer arguments (1, a multiple of 16, other): a count that grows
    while a benchmark measures means a compile stalled a step."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    kernels = {id(fn): fn for name, module in list(sys.modules.items()) if name.startswith("minivllm.kernels")
               for fn in vars(module).values() if isinstance(fn, JITFunction)}
    try:  # device -> (compiled kernels by key, ...) in triton 3.x
        return sum(len(entry[0]) for fn in kernels.values() for entry in fn.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


# ----------------------------------------------------------------------------- timing

def bench_ms(fn, arg_sets, warmup_ms=25, rep_ms=100, cuda_graph=False, graph_calls=1):
    """Median milliseconds of `fn(*args)`, rotating through `arg_sets` call after call.

    Rotation keeps the working set larger than L2 so we time memory, not the cache (do_bench
    also flushes L2 before each timed call). On CPU (smoke mode) a host clock stands in.
    cuda_graph: time replays of a graph captured per input set (`graph_replays`); with graph_calls
    N > 1, of one graph of N calls back to back (rotating through the sets), divided by N: a kernel
    of a few microseconds as a decode step runs it, between its neighbours, without the replay's
    own launch in its time.
    """
    counter = itertools.count()

    def call():
        fn(*arg_sets[next(counter) % len(arg_sets)])

    if torch.cuda.is_available():
        import triton.testing

        if cuda_graph:
            timed = graph_replays(arg_sets, lambda args: fn(*args), graph_calls)
        else:
            timed, graph_calls = call, 1
        return triton.testing.do_bench(timed, warmup=warmup_ms, rep=rep_ms, return_mode="median") / graph_calls
    times = []  # the correctness check already ran fn once: no further warm-up on CPU
    for _ in range(2):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def graph_replays(cases, call, calls_per_graph=1):
    """A function that replays, call after call, a CUDA graph of `call(case)` captured once per case:
    the engine's decode steps run their kernels from graphs, and eager launches of a kernel of a few
    microseconds would time the host. calls_per_graph N > 1: one graph of N calls instead, case
    after case in turn (the caller divides the time by N). On the CPU, plain calls in the same rotation."""
    counter = itertools.count()
    if not torch.cuda.is_available():
        return lambda: call(cases[next(counter) % len(cases)])
    for case in cases:
        call(case)  # compile outside the capture
    torch.cuda.synchronize()
    if calls_per_graph > 1:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls_per_graph):
                call(cases[i % len(cases)])
        return graph.replay
    graphs = []
    for case in cases:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(case)
        graphs.append(graph)
    return lambda: graphs[next(counter) % len(graphs)].replay()


def num_input_sets(bytes_per_set, factor=4, max_sets=8):
    """How many input sets to rotate so that together they span `factor` x the L2 cache."""
    l2 = l2_cache_bytes()
    if l2 is None:  # CPU smoke: two sets, so the rotation path still runs
        return 2
    return max(1, min(max_sets, math.ceil(factor * l2 / max(bytes_per_set, 1))))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(num_bytes):
    """Device-to-device copy rate in TB/s, counting bytes read + written."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda d, s: d.copy_(s), [(dst, src)])
    moved_bytes = 2 * num_bytes  # read src + write dst
    return {"bytes": num_bytes, "ms": ms, "TBps": moved_bytes / (ms * 1e-3) / 1e12}


def measure_matmul_rate(n, dtype):
    """torch.matmul rate on n x n x n in TFLOP/s (2 n^3 FLOPs)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = bench_ms(torch.matmul, [(a, b)])
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "ms": ms,
            "TFLOPs": 2 * n**3 / (ms * 1e-3) / 1e12}


# ----------------------------------------------------------------------------- providers

@dataclass
class Provider:
    """One way to compute the benchmarked op.

    prepare: input set -> args (untimed: layout changes, repeated K/V); run: *args -> output
    (timed); unpack: output -> the reference's layout (untimed). `label` names the variant.
    """
    name: str
    prepare: Callable
    run: Callable
    unpack: Callable = lambda out: out
    label: str = ""


@dataclass
class Measurement:
    provider: str
    status: str  # "ok", "FAIL" (ran, output wrong), "unavailable" (raised), "skipped"
    ms: float = None
    max_abs_err: float = None
    variant: str = ""
    error: str = ""
    tried: list = field(default_factory=list)

    def as_dict(self):
        return {k: v for k, v in self.__dict__.items() if v not in ("", None, [])}


def kernel_category(kernel_name: str, categories) -> str:
    """The label of the first (label, name fragments) rule whose fragment occurs in the lower-cased
    kernel name; "other" when none does (the profilers' kernel grouping)."""
    name = kernel_name.lower()
    for label, keys in categories:
        if any(k in name for k in keys):
            return label
    return "other"


def _short_error(exc):
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:240]


def _check(provider, input_sets, reference):
    """Prepare every set and run the first once; returns (arg_sets, max_abs_err)."""
    arg_sets = [provider.prepare(s) for s in input_sets]
    out = provider.unpack(provider.run(*arg_sets[0]))
    sync()
    if out.shape != reference.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(reference.shape)}")
    err = (out.float() - reference.float()).abs().max().item()
    return arg_sets, err if math.isfinite(err) else float("inf")


def measure(variants, input_sets, reference, atol, warmup_ms=25, rep_ms=100, cuda_graph=False, graph_calls=1):
    """Check each variant against the reference once, then time the first one that passes
    (`bench_ms`; cuda_graph: replays of a captured graph of graph_calls calls, per call).

    A variant that raises is skipped (its error is kept); if none passes, the first that ran is
    timed and marked FAIL; if none ran, the provider is "unavailable" with the errors.
    """
    tried, fallback = [], None
    for provider in variants:
        try:
            arg_sets, err = _check(provider, input_sets, reference)
        except Exception as exc:  # a backend that cannot take these inputs says so by raising
            tried.append(f"{provider.label or provider.name}: {_short_error(exc)}")
            _free_memory()
            continue
        if err <= atol:
            return _time(provider, arg_sets, err, "ok", tried, warmup_ms, rep_ms, cuda_graph, graph_calls)
        tried.append(f"{provider.label or provider.name}: max_abs_err {err:.3g} > {atol}")
        if fallback is None:
            fallback = (provider, err)
        del arg_sets
        _free_memory()
    if fallback is not None:
        provider, err = fallback
        arg_sets = [provider.prepare(s) for s in input_sets]
        return _time(provider, arg_sets, err, "FAIL", tried, warmup_ms, rep_ms, cuda_graph, graph_calls)
    return Measurement(variants[0].name, "unavailable", error=tried[0], tried=tried)


def _time(provider, arg_sets, err, status, tried, warmup_ms, rep_ms, cuda_graph=False, graph_calls=1):
    try:
        ms = bench_ms(provider.run, arg_sets, warmup_ms, rep_ms, cuda_graph, graph_calls)
    except Exception as exc:
        _free_memory()
        return Measurement(provider.name, "unavailable", error=_short_error(exc), tried=tried)
    return Measurement(provider.name, status, ms=ms, max_abs_err=err, variant=provider.label,
                       tried=tried)


def _free_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- SDPA

def sdpa(backend, q, k, v, **kwargs):
    """torch SDPA restricted to one backend ("flash", "cudnn", "efficient", "math").

    q: [batch, num_heads, seqlen_q, head_dim]; k, v: [batch, num_kv_heads, seqlen_k, head_dim].
    Raises when that backend cannot take the inputs (torch's "No available kernel").
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


def gqa_variants(num_heads, num_kv_heads):
    """Ways to hand GQA K/V to SDPA, tried in order: (label, kv transform, sdpa kwargs).

    enable_gqa lets the kernel share K/V across a group; "native" relies on a backend (cuDNN)
    accepting fewer K/V heads by itself; repeat_kv materialises the repeated heads (the kernel
    then reads group x more K/V bytes than the formula counts: note it when it is chosen).
    """
    group = num_heads // num_kv_heads
    same = lambda t: t  # noqa: E731
    repeat = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
    if group == 1:
        return [("", same, {})]
    return [("enable_gqa", same, {"enable_gqa": True}), ("native_gqa", same, {}),
            ("repeat_kv", repeat, {})]


def sdpa_backend_status(dtype, head_dim=128):
    """Does each SDPA backend run a small causal GQA call here? "available" or the error."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 4, 64, head_dim, dtype=dtype, device=device)
    kv = torch.randn(1, 2, 64, head_dim, dtype=dtype, device=device)
    status = {}
    for backend in SDPA_BACKENDS:
        errors = []
        for label, transform, kwargs in gqa_variants(4, 2):
            try:
                sdpa(backend, q, transform(kv), transform(kv), is_causal=True, **kwargs)
                status[backend] = f"available ({label})"
                break
            except Exception as exc:
                errors.append(_short_error(exc))
        else:
            status[backend] = "unavailable: " + errors[0]
    return status


# ----------------------------------------------------------------------------- engine parity

def step_logits(runner, out):
    """A scheduled step's logits through the runner (its layers: graphs, tensor parallelism), one row
    per sampled sequence, without sampling."""
    import torch

    with torch.inference_mode():
        batch = runner.upload(runner.prepare_inputs(out))
        return runner.compute_logits(batch, runner.forward(batch))


def teacher_forced_logits(llm, prompts, num_steps=4, vocab=10000):
    """{(tokens generated so far, prompt index): float32 logits on the host} over the first steps of
    an engine (prefills or prompt chunks, then decodes). The tokens fed back are fixed (teacher
    forcing), so two engines see the same inputs even where rounding flips a near-tie argmax, and
    however they schedule the prompts (ids below `vocab` and the model's vocabulary). Leaves the
    engine empty."""
    from minivllm import SamplingParams
    from minivllm.core.sequence import Sequence

    vocab = min(vocab, llm.config.hf_config.vocab_size)

    seqs = [Sequence(p, SamplingParams(temperature=0.0), llm.config.kvcache_block_size) for p in prompts]
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    for seq in seqs:
        llm.scheduler.add(seq)
    logits_by_step = {}
    for _ in range(num_steps):
        out = llm.scheduler.schedule()
        logits = step_logits(llm.model_runner, out)  # one row per sampled sequence
        for row, seq in enumerate(out.sampled_seqs):
            logits_by_step[seq.num_completion_tokens, index[seq.seq_id]] = logits[row].float().cpu()
        llm.scheduler.update_from_output(out, [(7919 * index[seq.seq_id] + 31 * seq.num_completion_tokens) % vocab
                                               for seq in out.sampled_seqs])
    for seq in seqs:
        if not seq.is_finished:
            llm.scheduler.finish(seq, "abort")
    return logits_by_step


# ----------------------------------------------------------------------------- output

def add_common_args(parser: argparse.ArgumentParser):
    parser.add_argument("--out-dir", type=Path, default=default_out_dir(),
                        help="where NAME.json and NAME.png go (default: benchmarks/results on a GPU, "
                             "benchmarks/results/cpu on a CPU)")
    parser.add_argument("--cpu-smoke", "--tiny", dest="cpu_smoke", action="store_true",
                        help="tiny sizes that finish in seconds on a CPU (Triton interpreter)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU (interpreter bf16 dots are broken)")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--copy-bytes", type=int, default=None,
                        help="size of the copy that measures bandwidth (default 1 GiB; 16 MiB on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def add_engine_args(parser: argparse.ArgumentParser, engines: str = "the engine"):
    """--engine-args: more LLM(...) keyword arguments as a JSON object, for an A/B run of one option."""
    from minivllm.entrypoints.arg_utils import json_object

    parser.add_argument("--engine-args", type=json_object, default={},
                        help=f"more LLM(...) keyword arguments for {engines}, as a JSON object, "
                             "e.g. '{\"small_batch_gemv\": true}'")
    return parser


def apply_smoke_defaults(args, parser, smoke_values):
    """--cpu-smoke: take the tiny value of each option the user left at its default."""
    for name, value in smoke_values.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


@dataclass
class Run:
    """What every script's main() starts from: parsed options, device, dtype, environment."""

    args: argparse.Namespace
    on_cuda: bool
    dtype: torch.dtype
    device: str
    env: dict


def start_run(parser, argv, smoke_values) -> Run:
    """Parse options (applying --cpu-smoke sizes), pick the interpreter without CUDA (before triton
    is imported), seed, and read the environment."""
    args = parser.parse_args(argv)
    on_cuda = use_interpreter_without_cuda()
    if args.cpu_smoke:
        apply_smoke_defaults(args, parser, smoke_values)
    torch.manual_seed(getattr(args, "seed", 0))
    return Run(args, on_cuda, resolve_dtype(args), "cuda" if on_cuda else "cpu", environment())


def resolve_dtype(args):
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return DTYPES[args.dtype]


def options_dict(args):
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(out_dir, name, payload):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def print_table(headers, rows, title=None):
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_numeric(r[i]) for r in cells[1:]) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _numeric(text):
    try:
        float(text.replace(",", "").rstrip("x%"))
        return True
    except ValueError:
        return text in ("-", "")


def fmt(value, digits=3):
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def plot_panels(path, panels, suptitle=""):
    """Grouped bar charts, one panel each: {"title", "categories", "series": {name: [value|None]},
    "ylabel", optional "hline": (label, value)}. Never raises: a missing matplotlib or a plotting
    error prints a note, because the measurements are already written to JSON."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped {path}")
        return None
    try:
        fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
        names = dict.fromkeys(name for panel in panels for name in panel["series"])  # one colour per name
        colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
        for ax, panel in zip(axes[:, 0], panels):
            _bar_panel(ax, panel, colors)
        if suptitle:
            fig.suptitle(suptitle, fontsize=10)
        return save_figure(fig, path)
    except Exception as exc:
        print(f"note: plotting failed ({_short_error(exc)}); the JSON has every figure")
        return None


def save_figure(fig, path):
    """Lay out, write (its folder made) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _bar_panel(ax, panel, colors=None):
    """One panel of plot_panels; colors: {series name: colour}, the same in every panel of a figure."""
    categories, series = panel["categories"], panel["series"]
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name, color=(colors or {}).get(name))
        for bar, v in zip(bars, values):
            if v is None:
                ax.annotate("n/a", (bar.get_x() + width / 2, 0), ha="center", va="bottom", fontsize=6)
    if panel.get("hline"):
        label, value = panel["hline"]
        ax.axhline(value, color="black", linestyle="--", linewidth=1, label=label)
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, fontsize=8)
    ax.set_ylabel(panel["ylabel"])
    ax.set_title(panel["title"], fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
