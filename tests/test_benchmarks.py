"""Smoke tests of the paired benchmarks' CPU-sized mode, and exact checks of their formulas.

The scripts run in a subprocess (a fresh interpreter, TRITON_INTERPRET set before triton loads
on a CPU-only machine),
as CI and a reader would run them: `python -m benchmarks.NAME --cpu-smoke --out-dir DIR`.
"""
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STATUSES = {"ok", "FAIL", "unavailable", "skipped"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_ABS_ERR = {"float32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}  # vs the float32 reference


def run_benchmark(name, out_dir, *extra, timeout=240, cpu_only=False, png=True):
    """cpu_only: hide the GPUs (runs that need chunked prefill, which a GPU engine refuses for now);
    png: the run draws its plot."""
    # Tiny sizes on whatever device there is: the GPU (bfloat16) on a CUDA machine, else the CPU
    # (float32) with the Triton kernels in the interpreter. Tolerances and byte counts follow the dtype.
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cpu_only or not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--cpu-smoke", "--out-dir", str(out_dir),
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((out_dir / f"{name}.json").read_text())
    if png and importlib.util.find_spec("matplotlib"):
        assert (out_dir / f"{name}.png").stat().st_size > 0
    return payload, proc.stdout


def check_environment(payload, name):
    assert payload["benchmark"] == name
    for key in ("device", "torch", "triton", "transformers", "date_utc"):
        assert payload["environment"][key], key
    assert payload["options"]["cpu_smoke"] is True


def test_bench_prefill_cpu_smoke(tmp_path):
    payload, stdout = run_benchmark("bench_prefill", tmp_path)
    check_environment(payload, "bench_prefill")
    rows = payload["results"]
    heads, head_dim = payload["options"]["num_heads"], payload["options"]["head_dim"]
    max_err = MAX_ABS_ERR[payload["options"]["dtype"]]
    by_case = {}
    for row in rows:
        assert row["status"] in STATUSES and row["status"] != "FAIL", row
        by_case.setdefault(row["case"], {})[row["provider"]] = row
    chunk_cases = {"chunk 16 over 40", "48 in 16-token chunks", "3 decodes (ctx 40) + chunk 16 over 16"}
    assert set(by_case) == {"1x64", "2x32", "mixed(3 seqs,48 tok)", "prefix-hit 2x32"} | chunk_cases
    alternatives = {"3 decodes (ctx 40) + chunk 16 over 16": "ours_unified"}
    for case, providers in by_case.items():
        extra = {alternatives[case]} if case in alternatives else set()
        assert set(providers) == {"ours", "naive", "sdpa_flash", "sdpa_cudnn"} | extra, case
        for provider in ("ours", "naive", *extra):  # the naive version and ours must always run here
            row = providers[provider]
            assert row["status"] == "ok", (row.get("error"), row)
            assert row["max_abs_err"] < max_err and row["ms"] > 0
            assert row["TFLOPs"] == pytest.approx(row["flops"] / (row["ms"] * 1e-3) / 1e12)  # units
        naive, ours = providers["naive"], providers["ours"]
        assert naive["ours_speedup"] == pytest.approx(naive["ms"] / ours["ms"])  # ratio against the ours row
        assert naive["flops"] == ours["flops"] == brute_force_causal_flops(ours, heads, head_dim)
    # causal FLOPs = 2*B*H*S^2*D with all tokens new; prefix hit: 4*H*D*(Sq*(Sk-Sq) + Sq^2/2) per sequence
    assert by_case["1x64"]["ours"]["flops"] == 2 * 1 * heads * 64**2 * head_dim
    assert by_case["2x32"]["ours"]["flops"] == 2 * 2 * heads * 32**2 * head_dim
    assert by_case["prefix-hit 2x32"]["ours"]["flops"] == 2 * 4 * heads * head_dim * (16 * 16 + 16**2 / 2)
    assert by_case["chunk 16 over 40"]["ours"]["flops"] == 4 * heads * head_dim * (16 * 40 + 16**2 / 2)
    # the series: chunks [0,16) [16,32) [32,48), each over the ones before
    assert by_case["48 in 16-token chunks"]["ours"]["flops"] == 4 * heads * head_dim * sum(
        16 * prefix + 16**2 / 2 for prefix in (0, 16, 32))
    assert by_case["3 decodes (ctx 40) + chunk 16 over 16"]["ours"]["flops"] == 4 * heads * head_dim * (
        3 * (39 + 0.5) + 16 * 16 + 16**2 / 2)
    assert "ours speedup" in stdout.strip().splitlines()[-len(rows) - 2]  # the table is printed last


def brute_force_causal_flops(row, num_heads, head_dim):
    """4 * H * D FLOPs per unmasked (query, key) pair, the pairs counted on an explicit causal mask
    (queries are the last tokens); flash-attn's convention drops half of the diagonal."""
    pairs = 0
    for seqlen_k, num_cached in zip(row["seqlens_k"], row["num_cached"]):
        seqlen_q = seqlen_k - num_cached
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(diagonal=seqlen_k - seqlen_q)
        pairs += int(mask.sum()) - seqlen_q / 2
    return 4 * num_heads * head_dim * pairs


def test_measure_flags_wrong_output_and_errors():
    """What makes the smoke tests' `status == "ok"` mean something: the harness marks a provider
    whose output is off by more than atol FAIL, and one that raises unavailable."""
    from benchmarks import common

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the harness times
    reference = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    inputs = [reference.clone()]

    def provider(name, run):
        return common.Provider(name, prepare=lambda x: (x,), run=run)

    def broken(x):
        raise RuntimeError("no kernel for this shape")

    right = provider("right", lambda x: x * 1.0)
    wrong = provider("wrong", lambda x: x + torch.eye(3, 4, device=device) * 0.5)
    ok = common.measure([right], inputs, reference, atol=1e-3, warmup_ms=1, rep_ms=1)
    assert ok.status == "ok" and ok.max_abs_err == 0 and ok.ms > 0
    fail = common.measure([wrong], inputs, reference, atol=1e-3, warmup_ms=1, rep_ms=1)
    assert fail.status == "FAIL" and fail.max_abs_err == pytest.approx(0.5) and "0.5 > 0.001" in fail.tried[0]
    gone = common.measure([provider("broken", broken)], inputs, reference, atol=1e-3, warmup_ms=1, rep_ms=1)
    assert gone.status == "unavailable" and "no kernel for this shape" in gone.error and gone.ms is None
    fallback = common.measure([provider("broken", broken), right], inputs, reference, atol=1e-3,
                              warmup_ms=1, rep_ms=1)
    assert fallback.status == "ok" and fallback.provider == "right" and "no kernel" in fallback.tried[0]


def test_bench_gemv_cpu_smoke(tmp_path):
    """Every provider passes its check at every shape; the byte formula, the floor and the layer sums are exact."""
    payload, stdout = run_benchmark("bench_gemv", tmp_path)
    check_environment(payload, "bench_gemv")
    rows, copy_tbps = payload["results"], payload["ceilings"]["copy"]["TBps"]
    assert {(r["layer"], r["M"], r["provider"]) for r in rows} == {
        (layer, m, p) for layer in ("qkv", "o", "down", "lm_head") for m in (1, 3)
        for p in ("naive", "unfused", "cublas", "ours")}
    itemsize = ITEMSIZE[payload["options"]["dtype"]]
    for row in rows:
        assert row["status"] == "ok", (row.get("error"), row)
        M, N, K = row["M"], row["N"], row["K"]
        out_itemsize = 4 if row["layer"] == "lm_head" else itemsize
        inputs = 2 * M * K if row["prologue"] in ("add_rms_norm", "silu_and_mul") else M * K
        extra = M * K * itemsize if row["prologue"] == "add_rms_norm" else 0
        assert row["bytes"] == N * K * itemsize + inputs * itemsize + M * N * out_itemsize + extra
        assert row["floor_ms"] == pytest.approx(row["bytes"] / (copy_tbps * 1e12) * 1e3)
    for layer_row in payload["layer"]:  # qkv + o + down of the tiny model (it has no gate_up)
        parts = [r for r in rows if r["M"] == layer_row["M"] and r["provider"] == layer_row["provider"]
                 and r["layer"] != "lm_head"]
        assert len(parts) == 3 and layer_row["ms"] == pytest.approx(sum(r["ms"] for r in parts))
    assert "ours / unfused" in stdout and "lm_head M=3" in stdout


def test_bench_gemv_sweeps_both_paths_of_the_tiles_it_is_given(tmp_path):
    """--sweep-dot both times each given tile with multiply-adds and with tl.dot (a dot only from 16 columns
    wide), at each given split that leaves a program two K tiles; every swept config passed its check."""
    payload, stdout = run_benchmark("bench_gemv", tmp_path, "--sweep", "--sweep-dot", "both", "--sweep-tiles",
                                    "8x32x4,16x32x4", "--sweep-splits", "1,2", "--batches", "3")
    best = {r["layer"]: r for r in payload["results"] if r["provider"] == "best"}
    assert set(best) == {"qkv", "o", "down", "lm_head"} and "best:" in stdout
    for layer, row in best.items():
        K = row["K"]
        expected = {(n, 32, split, dot) for n in (8, 16) for split in (1, 2) for dot in (False, True)
                    if not (split > 1 and K // split < 64) and not (dot and n < 16)}
        timed = {(c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["DOT"]) for c in row["sweep"]}
        assert row["status"] == "ok" and timed == expected, (layer, timed ^ expected)
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, "-m", "benchmarks.bench_gemv", "--sweep-tiles", "16x32"], cwd=REPO,
                       check=True, capture_output=True, timeout=60)


def test_bench_fp8_gemm_cpu_smoke(tmp_path):
    """Every provider runs and passes its check on tiny shapes; the formulas and ratios are exact."""
    payload, stdout = run_benchmark("bench_fp8_gemm", tmp_path)
    check_environment(payload, "bench_fp8_gemm")
    rows = payload["results"]
    by_case = {}
    for row in rows:
        assert row["status"] == "ok", (row.get("error"), row)
        by_case.setdefault(row["case"], {})[row["provider"]] = row
    assert set(by_case) == {f"tiny {layer} M={m}" for layer in ("qkv", "down") for m in (1, 7, 33)}
    for case, providers in by_case.items():
        assert set(providers) == {"naive", "ours", "ours+quant", "scaled_mm", "scaled_mm+quant", "bf16"}, case
        M, N, K = (providers["ours"][k] for k in ("M", "N", "K"))
        for row in providers.values():
            assert row["flops"] == 2 * M * N * K
            assert row["TFLOPs"] == pytest.approx(row["flops"] / (row["ms"] * 1e-3) / 1e12)
            assert row["speedup_over_bf16"] == pytest.approx(providers["bf16"]["ms"] / row["ms"])
        assert providers["ours"]["bytes"] == N * K + M * K + 2 * M * N  # fp8 weight and activations, bf16 out
        assert providers["bf16"]["bytes"] == 2 * N * K + 2 * M * K + 2 * M * N
        assert providers["ours"]["vs_scaled_mm"] == pytest.approx(providers["ours"]["ms"] / providers["scaled_mm"]["ms"])
    assert "ours (Triton block-FP8) / torch._scaled_mm" in stdout


def run_tune_smoke(tmp_path, only, kind):
    """tune_kernels.py --only ONLY --smoke, on the GPU where there is one, else in the interpreter: the
    finished process (every config checked and none wrong) and tune.json's rows of `kind`."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "benchmarks/tune_kernels.py", "--out", str(tmp_path), "--skip-tests",
                           "--only", only, "--smoke"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WRONG" not in proc.stdout and "failed" not in proc.stdout, proc.stdout
    return proc, [r for r in json.loads((tmp_path / "tune.json").read_text())["rows"] if r["kind"] == kind]


def test_tune_kernels_fp8_gemm_smoke(tmp_path):
    """The GEMM tile sweep on tiny shapes, on the GPU where there is one, else on the CPU (interpreter):
    every tile passes its check against the reference and is timed, beside gemm_config's own choice, and
    the best tile per shape is named. (Not forced onto the interpreter on a GPU machine: triton 3.6's
    interpreter with numpy 2.4 cannot run this kernel's K loop, a 1-element array where range() wants an
    int; triton 3.9's can.)"""
    proc, rows = run_tune_smoke(tmp_path, "fp8-gemm", "fp8_gemm")
    for shape in ("tiny_qkv_M1", "tiny_qkv_M33"):
        providers = {r["provider"] for r in rows if r["shape"] == shape}
        assert {"16x64 w4 s5", "16x128 w4 s5"} <= providers and any(p.startswith("default ") for p in providers)
        assert f"best {shape}" in proc.stdout
    assert all(r["ms"] > 0 for r in rows)


def test_tune_kernels_decode_fp8_smoke(tmp_path):
    """The FP8-cache decode sweep on a tiny shape: the first tile with each conversion and row padding,
    every one checked against the reference and timed, and the best named."""
    proc, rows = run_tune_smoke(tmp_path, "decode-fp8", "decode_fp8")
    names = {r["provider"] for r in rows if r["provider"].startswith("triton ")}
    assert names == {f"triton n64 w4 s2 p8 m256 splits1 m{rows} {convert}" for rows in (16, 64)
                     for convert in ("cvt", "bits")}
    assert "best 2x64/b16" in proc.stdout and all(r["ms"] > 0 for r in rows)


def test_tune_kernels_moe_smoke(tmp_path):
    """The fused-MoE sweep on tiny shapes: both paths' configs (aligned tiles, few-pairs tiles up to
    MOE_SMALL_MAX_M tokens) pass their check against the reference and are timed beside moe_config's
    own choice, and the best config per M is named."""
    proc, rows = run_tune_smoke(tmp_path, "moe", "moe")
    providers = {shape: {r["provider"] for r in rows if r["shape"] == shape} for shape in ("M1", "M33")}
    assert "few-pairs 16x32 w4" in providers["M1"] and not any("few-pairs" in p for p in providers["M33"])
    assert all(any(p.endswith("(default)") for p in names) and len(names) >= 2 for names in providers.values())
    assert "best M1" in proc.stdout and "best M33" in proc.stdout
    assert all(r["ms"] > 0 for r in rows)


def test_bench_decode_cpu_smoke(tmp_path):
    payload, stdout = run_benchmark("bench_decode", tmp_path, "--kv-cache-dtype", "auto", "fp8")
    check_environment(payload, "bench_decode")
    opts, rows = payload["options"], payload["results"]
    assert payload["ceilings"]["copy"]["TBps"] > 0
    seen = set()
    for row in rows:
        assert row["status"] in STATUSES and row["status"] != "FAIL", row
        seen.add((row["case"], row["provider"], row["block_size"]))
        fp8 = row["provider"].startswith("ours_fp8")
        itemsize = 1 if fp8 else ITEMSIZE[opts["dtype"]]  # float32 on CPU, bfloat16 on CUDA; FP8 1 byte
        assert row["kv_cache_dtype"] == ("float8_e4m3fn" if fp8 else opts["dtype"])
        assert row["kv_bytes"] == 2 * row["batch"] * row["context"] * opts["num_kv_heads"] * opts["head_dim"] * itemsize
        if row["provider"] in ("ours", "ours_fp8", "naive"):
            assert row["status"] == "ok" and row["max_abs_err"] < MAX_ABS_ERR[opts["dtype"]], (row.get("error"), row)
            assert row["TBps"] == pytest.approx(row["kv_bytes"] / (row["ms"] * 1e-3) / 1e12)
            assert row["fraction_of_copy"] == pytest.approx(row["TBps"] / payload["ceilings"]["copy"]["TBps"])
    by_key = {(r["case"], r["provider"], r["block_size"]): r for r in rows}
    for case in ("1x80", "3x48"):
        for bs in opts["block_sizes"]:  # ratios against ours at the same block size
            ours, naive = by_key[(case, "ours", bs)], by_key[(case, "naive", bs)]
            assert naive["ours_speedup"] == pytest.approx(naive["ms"] / ours["ms"]) and ours["ours_block_size"] == bs
    ours = ("ours", "ours_fp8") + (("ours_graph", "ours_fp8_graph") if torch.cuda.is_available() else ())
    expected = {(case, p, bs) for case in ("1x80", "3x48") for p in ours + ("naive",) for bs in opts["block_sizes"]}
    expected |= {(case, f"sdpa_{b}", None) for case in ("1x80", "3x48") for b in ("flash", "cudnn")}
    assert seen == expected
    assert "ours speedup" in stdout


def test_throughput_workload_is_nano_vllms():
    """make_workload draws what nano-vllm's bench.py draws (its procedure, WORKLOAD_PROCEDURE, written
    out below with the global `random` functions that script calls), and the recorded throughput run
    in benchmarks/results is that draw for its own options."""
    import random

    from benchmarks.bench_throughput import WORKLOAD_PROCEDURE, make_workload

    assert "random.seed(seed)" in WORKLOAD_PROCEDURE and "randint(0, max_token_id)" in WORKLOAD_PROCEDURE
    state = random.getstate()
    try:
        random.seed(3)
        prompts = [[random.randint(0, 500) for _ in range(random.randint(5, 40))] for _ in range(20)]
        output_lens = [random.randint(5, 40) for _ in range(20)]
    finally:
        random.setstate(state)
    assert make_workload(20, 5, 40, 500, seed=3) == (prompts, output_lens)

    recorded = json.loads((REPO / "benchmarks" / "results" / "bench_throughput.json").read_text())
    opts = recorded["options"]
    prompts, output_lens = make_workload(opts["num_requests"], opts["min_len"], opts["max_len"],
                                         opts["max_token_id"], seed=opts["seed"])
    work = recorded["workload"]
    assert (work["num_requests"], work["prompt_tokens"], work["output_tokens"]) == \
        (len(prompts), sum(map(len, prompts)), sum(output_lens))
    assert recorded["minivllm"]["output_tokens"] == sum(output_lens)  # ignore_eos: every request runs to its length
    assert min(map(min, prompts)) >= 0 and max(map(max, prompts)) <= opts["max_token_id"]
    assert all(opts["min_len"] <= n <= opts["max_len"] for n in output_lens + [len(p) for p in prompts])


def write_header_only_safetensors(path, shapes):
    """A safetensors header naming tensors and shapes (the floor reads only headers)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_roofline_floor_of_qwen3_0_6b(tmp_path):
    """The floor arithmetic of chapter 08: 114,688 KV bytes per context token per step, ~121M token-steps."""
    from benchmarks.bench_throughput import make_workload, roofline_floor

    config = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  hidden_size=1024, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_header_only_safetensors(tmp_path / "model.safetensors",
                                  {"model.embed_tokens.weight": (151936, 1024), "model.layers.all": (440_000_000,)})
    prompts, output_lens = make_workload(256, 100, 1024, 10000, seed=0)
    floor = roofline_floor(tmp_path, prompts, output_lens, max_num_seqs=256, itemsize=2, copy_tbps=4.0,
                           matmul_tflops=500.0)
    brute_steps = sum(p + j for p, n in zip(map(len, prompts), output_lens) for j in range(1, n))
    assert floor["kv_bytes_per_context_token"] == 28 * 2 * 8 * 128 * 2 == 114_688
    assert floor["decode_context_token_steps"] == brute_steps
    assert floor["decode_steps_lower_bound"] == max(output_lens) - 1  # longer than ceil(tokens / 256)
    assert floor["weight_bytes_per_step"] == (440_000_000 + 151936 * 1024) * 2
    assert floor["seconds"] == pytest.approx(
        (floor["decode_kv_bytes"] + floor["decode_weight_bytes"]) / 4e12 + floor["prefill_flops"] / 500e12)
    # An FP8 cache: 1 byte per K/V element, the weights unchanged.
    fp8 = roofline_floor(tmp_path, prompts, output_lens, max_num_seqs=256, itemsize=2, copy_tbps=4.0,
                         matmul_tflops=500.0, kv_itemsize=1)
    assert fp8["kv_bytes_per_context_token"] == 57_344 and fp8["decode_kv_bytes"] * 2 == floor["decode_kv_bytes"]
    assert fp8["weight_bytes_per_step"] == floor["weight_bytes_per_step"]
    assert fp8["seconds"] == pytest.approx(floor["seconds"] - floor["kv_seconds"] / 2)


def test_roofline_floor_of_a_mixture_of_experts(tmp_path):
    """Qwen3-30B-A3B's shape: each token multiplies 8 of 128 experts (prefill FLOPs count 1/16 of the
    expert weights), and the decode reads the experts as its steps pick them: at least every expert
    once per 256 decode tokens at max_num_seqs 256 (f(256) ~ 1), and 8 of 128 per step."""
    from benchmarks.bench_throughput import expert_fraction_read, make_workload, roofline_floor

    E, k, layers, hidden, n = 128, 8, 48, 2048, 768
    config = dict(num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  hidden_size=hidden, vocab_size=151936, num_experts=E, num_experts_per_tok=k)
    (tmp_path / "config.json").write_text(json.dumps(config))
    experts = layers * E * 3 * n * hidden
    write_header_only_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": (151936, hidden), "lm_head.weight": (151936, hidden),
        "model.layers.0.mlp.experts.gate_up_proj": (experts,), "model.layers.all.other": (1_000_000_000,)})
    prompts, output_lens = make_workload(256, 100, 1024, 10000, seed=0)
    floor = roofline_floor(tmp_path, prompts, output_lens, max_num_seqs=256, itemsize=2, copy_tbps=4.0,
                           matmul_tflops=500.0)
    assert floor["params"]["experts"] == experts and floor["params"]["layers"] == 1_000_000_000
    decode_tokens = sum(n - 1 for n in output_lens)
    assert expert_fraction_read(1, E, k) == pytest.approx(k / E)
    assert floor["decode_expert_reads"] == pytest.approx(
        max(decode_tokens * expert_fraction_read(256, E, k) / 256, floor["decode_steps_lower_bound"] * k / E))
    assert floor["decode_weight_bytes"] == pytest.approx(
        floor["decode_steps_lower_bound"] * (1_000_000_000 + 151936 * hidden) * 2 + floor["decode_expert_reads"] * experts * 2)
    attention = 2 * layers * 32 * 128 * sum(len(p) ** 2 for p in prompts)
    assert floor["prefill_flops"] == pytest.approx(
        2 * (1_000_000_000 + experts * k / E) * sum(map(len, prompts)) + 2 * 151936 * hidden * 256 + attention)
    # one request decoding alone: every step reads exactly k of E experts' worth
    alone = roofline_floor(tmp_path, prompts[:1], output_lens[:1], max_num_seqs=1, itemsize=2, copy_tbps=4.0,
                           matmul_tflops=500.0)
    assert alone["decode_expert_reads"] == pytest.approx((output_lens[0] - 1) * k / E)
    # transformers 5 writes the expert count as num_local_experts: the same floor
    config["num_local_experts"] = config.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert roofline_floor(tmp_path, prompts, output_lens, max_num_seqs=256, itemsize=2, copy_tbps=4.0,
                          matmul_tflops=500.0) == floor


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen3-tiny"])
def test_count_params_of_a_config_only_directory(tmp_path, preset):
    """--load-format dummy's floor counts the parameters from the config (transformers' model on the meta
    device) exactly as a checkpoint's safetensors headers count them, tied head and experts included."""
    from benchmarks.bench_throughput import count_params
    from minivllm.tools.make_model import make_config_dir, make_model

    assert count_params(make_config_dir(preset, tmp_path / "cfg")) == count_params(make_model(preset, tmp_path / "m"))


def test_bench_throughput_tiny(tmp_path):
    """Both engines on 4 short requests of qwen3-tiny (the LLM API and make_model must exist);
    --engine-args reaches both of minivllm's runs."""
    pytest.importorskip("minivllm.llm", reason="minivllm.llm (the LLM API) does not exist yet")
    pytest.importorskip("minivllm.tools.make_model", reason="minivllm.tools.make_model does not exist yet")
    payload, stdout = run_benchmark("bench_throughput", tmp_path, "--model-cache", str(tmp_path / "models"),
                                    "--compare-chunked-prefill", "--engine-args", '{"kvcache_block_size": 8}',
                                    timeout=400, cpu_only=True)
    check_environment(payload, "bench_throughput")
    work = payload["workload"]
    assert work["num_requests"] == 4
    for engine in ("minivllm", "hf"):
        result = payload[engine]
        assert "error" not in result, result
        assert result["output_tokens"] == work["output_tokens"] and result["seconds"] > 0
    assert payload["minivllm"]["output_tokens_match_requested"]
    assert payload["ratio_minivllm_over_hf_output_tok_per_s"] == pytest.approx(
        payload["minivllm"]["output_tok_per_s"] / payload["hf"]["output_tok_per_s"])
    assert 0 < payload["floor"]["seconds"] and "of floor" in stdout
    other = payload["minivllm_other_chunking"]  # the same workload with chunked prefill off
    assert other["engine"]["enable_chunked_prefill"] == "False" and payload["minivllm"]["engine"]["enable_chunked_prefill"] == "True"
    assert other["output_tokens_match_requested"] and "chunked prefill off" in stdout
    assert payload["minivllm"]["engine"]["kvcache_block_size"] == other["engine"]["kvcache_block_size"] == "8"


def test_compare_chunked_prefill_flips_the_first_runs_setting():
    """--compare-chunked-prefill runs the other setting from the one the first run used, whether that came
    from --no-chunked-prefill or from the engine's default (flipping a fixed setting instead would run the
    same setting twice whenever the default equals it)."""
    from benchmarks.bench_throughput import other_chunking

    assert other_chunking({"engine": {"enable_chunked_prefill": "False"}}) is True
    assert other_chunking({"engine": {"enable_chunked_prefill": "True"}}) is False


def test_bench_chunked_latency_tiny(tmp_path):
    """Streams decoding while a long prompt arrives, chunked prefill on and off, on qwen3-tiny."""
    payload, stdout = run_benchmark("bench_chunked_latency", tmp_path, "--model-cache", str(tmp_path / "models"),
                                    cpu_only=True)
    check_environment(payload, "bench_chunked_latency")
    on, off = payload["results"]
    assert (on["chunked_prefill"], off["chunked_prefill"]) == (True, False)
    assert on["max_num_batched_tokens"] == 32 and off["max_num_batched_tokens"] >= 200
    for r in (on, off):
        assert r["num_gaps"] >= 2 * 4 - 1 and r["max_gap_s"] >= r["median_gap_s"] > 0 and r["ttft_s"] > 0
    # Both computed the same prompt tokens: 4 streams x 8 and the 200-token prompt (no prefix cache).
    assert on["prefill_tokens"] == off["prefill_tokens"] == 4 * 8 + 200
    assert "longest / median" in stdout


def test_probe_decode_bound_cpu_smoke(tmp_path):
    """Both caches, both placements, timed; the FP8 cache's output close to the unquantized one's."""
    payload, stdout = run_benchmark("probe_decode_bound", tmp_path)
    check_environment(payload, "probe_decode_bound")
    rows = payload["rows"]
    assert [r["cache"] for r in rows] == [payload["options"]["dtype"], "fp8"]
    for r in rows:
        assert r["hbm_ms"] > 0 and r["l2_ms"] > 0 and r["l2_over_hbm"] == pytest.approx(r["l2_ms"] / r["hbm_ms"])
        for where in ("hbm", "l2"):  # e4m3 keeps 3 mantissa bits: |error| of a softmax average of N(0,1) values
            assert 0 < r["max_abs_diff_fp8_vs_unquantized"][where] < 0.1
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[payload["options"]["dtype"]]
    assert rows[1]["GB_read"] * itemsize == pytest.approx(rows[0]["GB_read"])  # vs 1-byte codes
    assert "L2 / HBM time" in stdout


# ncu's CSV pages in the shape ncu_stalls reads (`--page raw --csv`: names, units, a row per kernel;
# `--page source --csv --print-source sass`: a row per SASS line): the parsing, not ncu, which needs a GPU.
NCU_RAW = """==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"
"","","usecond","ratio","ratio"
"0","paged_decode_kernel","1,234.5","0.25","3.5"
""".replace("\\\n", "")
NCU_SOURCE = """"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x10","LDG.E.128 R4, [R2.64]","10","8"
"0x20","F2FP.BF16.F32.PACK_AB R0, R1, R2","30","25"
"0x30","HMMA.16816.F32.BF16 R8, R4, R12, R8","60","50"
"""


def test_ncu_stalls_parses_its_pages():
    from benchmarks import ncu_stalls

    metrics = ncu_stalls.parse_raw(NCU_RAW)
    assert metrics["gpu__time_duration.sum"] == 1234.5 and metrics["Kernel Name"] == "paged_decode_kernel"
    assert list(ncu_stalls.stall_ratios(metrics).items()) == [("long_scoreboard", 3.5), ("barrier", 0.25)]
    top = ncu_stalls.top_stall_lines(NCU_SOURCE, count=2)
    assert [(address, samples) for address, _, samples, _ in top] == [("0x30", 60.0), ("0x20", 30.0)]
    assert top[0][1].startswith("HMMA") and top[0][3] == pytest.approx(0.6)
    assert ncu_stalls.parse_raw("no csv here") == {} and ncu_stalls.top_stall_lines("") == []


def test_probe_decode_bound_ncu_child_and_missing_ncu(tmp_path):
    """The process ncu would profile makes its three calls and exits 0; --ncu without ncu on PATH stops
    with a clear message before any timing."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    base = [sys.executable, "-m", "benchmarks.probe_decode_bound", "--cpu-smoke", "--out-dir", str(tmp_path)]
    child = subprocess.run(base + ["--ncu-child", "fp8"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    missing = subprocess.run(base + ["--ncu"], cwd=REPO, env=dict(env, PATH="/nonexistent"), capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode != 0 and "needs Nsight Compute's ncu on PATH" in missing.stderr
    assert "HBM" not in missing.stdout


def test_throughput_workload_fixed_lengths():
    from benchmarks.bench_throughput import make_workload

    prompts, output_lens = make_workload(5, 100, 1024, 10000, seed=0, input_len=256, output_len=512)
    assert [len(p) for p in prompts] == [256] * 5 and output_lens == [512] * 5
    drawn, _ = make_workload(5, 100, 1024, 10000, seed=0)
    assert {len(p) for p in drawn} != {256}


def test_bench_throughput_compare_unquantized_tiny(tmp_path):
    """An FP8 cache and the model's dtype on the same fixed-length workload, same run, each against its
    own floor, with the ratio of their output rates."""
    payload, stdout = run_benchmark("bench_throughput", tmp_path, "--model-cache", str(tmp_path / "models"),
                                    "--kv-cache-dtype", "fp8", "--compare-unquantized", "--skip-hf",
                                    "--input-len", "12", "--output-len", "6", timeout=400, cpu_only=True)
    work, fp8, base = payload["workload"], payload["minivllm"], payload["minivllm_unquantized"]
    assert work["prompt_tokens"] == 4 * 12 and work["output_tokens"] == 4 * 6
    assert fp8["engine"]["kv_cache_torch_dtype"] == "torch.float8_e4m3fn"
    assert base["engine"]["kv_cache_torch_dtype"] == "torch.float32"
    for run in (fp8, base):
        assert run["output_tokens_match_requested"] and run["seconds"] > 0
    assert payload["ratio_quantized_over_unquantized_output_tok_per_s"] == pytest.approx(
        fp8["output_tok_per_s"] / base["output_tok_per_s"])
    assert payload["floor"]["decode_kv_bytes"] * 4 == payload["floor_unquantized"]["decode_kv_bytes"]
    assert "FP8 / unquantized output tok/s" in stdout and "FP8 KV" in stdout


def test_bench_latency_cpu_smoke(tmp_path):
    """Decode steps at two batch sizes and TTFT at two prompt lengths, each beside its floor: the
    weights (once) and the KV read over the measured bandwidth; the prefill's FLOPs over the matmul rate."""
    payload, stdout = run_benchmark("bench_latency", tmp_path)
    check_environment(payload, "bench_latency")
    assert set(payload["decode_step_ms"]) == {"1", "2"} and set(payload["ttft_ms"]) == {"16", "64"}
    assert all(ms > 0 for ms in [*payload["decode_step_ms"].values(), *payload["ttft_ms"].values()])
    floor, tbps = payload["floor"], payload["copy"]["TBps"]
    for batch, ms in floor["decode_ms"].items():
        kv = int(batch) * (32 + 8 / 2) * floor["kv_bytes_per_token"]
        assert ms == pytest.approx((floor["weight_bytes"] + kv) / (tbps * 1e12) * 1e3)
    assert floor["decode_ms"]["2"] > floor["decode_ms"]["1"]
    assert "over the floor" in stdout


def test_every_benchmark_imports():
    """Each script imports against today's engine (a renamed class fails here, not in a reader's run)."""
    names = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(f'benchmarks.{name}')\n"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bench_step_message_cpu_smoke(tmp_path):
    """Every transport carries the engine's header (HEADER_SIZE int64) and the decode inputs."""
    from minivllm.engine.executor import HEADER_SIZE

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_step_message", "--cpu-smoke", "--out-dir",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "bench_step_message.json").read_text())
    assert payload["header_bytes"] == 8 * HEADER_SIZE
    sizes = list(payload["results"].values())
    assert [s["payload_bytes"] for s in sizes] == [0, 4 * 8 * (5 + 8)]  # --cpu-smoke: batch 8, 8 blocks
    for size in sizes:
        for transport, times in size.items():
            if transport != "payload_bytes":
                assert 0 < times["median_us"] <= times["p90_us"], (transport, times)


def test_bench_spec_decode_cpu_smoke(tmp_path):
    """No speculation, n-gram k=2 drafting at every batch size, the default rule, and the draft-model
    proposer (the target itself, and its first layer) on qwen3-tiny: the same greedy tokens, drafts
    accepted (every one when the draft is the target), a ratio per batch size."""
    payload, stdout = run_benchmark("bench_spec_decode", tmp_path, "--trace", "--draft-model", "--sampler",
                                    "--profile-kernels")
    check_environment(payload, "bench_spec_decode")
    spec = payload["spec"]
    assert set(spec) == {"none", "ngram k=2", "ngram k=2 prefill-verify", "ngram k=2 default", "draft=target k=2",
                         "draft 1-layer k=2"}
    for r in spec["draft=target k=2"].values():
        assert r["num_accepted_tokens"] == r["num_draft_tokens"] > 0, r
    for name, by_batch in spec.items():
        assert set(by_batch) == {"1", "2"}
        for batch, r in by_batch.items():
            assert r["same_tokens_as_none"] and r["agreement"] == 1.0 and r["tokens"] == int(r["tokens"]) > 0 and r["output_tok_s"] > 0
            assert (r["num_drafts"] > 0 and r["acceptance_length"] > 1) == (name != "none")
            # the steps with drafts apart: more tokens than sequences; the decode steps one a sequence
            assert ("verify" in r["trace"]) == (name != "none")
            assert r["trace"].get("decode", {"tokens_per_step": 1})["tokens_per_step"] <= int(batch)
            if name != "none":
                assert r["trace"]["verify"]["tokens_per_step"] > 1 and r["trace"]["verify"]["acceptance_length"] > 1
            # --profile-kernels: at the first batch size only, after its timed run (the second batch's tokens
            # above show the aborted requests left nothing behind); GPU kernels, so none on a CPU
            assert ("kernels" in r) == (batch == "1"), (name, batch)
            if batch == "1":
                assert r["kernels"]["steps"] == 10
                assert (r["kernels"]["kernels_per_step"] > 0) == torch.cuda.is_available()
                # the forwards those 10 engine steps collected, by kind: verify steps where drafts ran
                forwards = r["kernels"]["forwards"]
                assert 0 < sum(forwards.values()) <= 10 and set(forwards) <= {"decode", "verify"}, forwards
                assert ("verify" in forwards) == (name != "none"), (name, forwards)
    assert "vs none" in stdout and "the step trace" in stdout and "GPU kernels per engine step" in stdout
    assert "forwards collected" in stdout
    assert set(payload["sampler"]) == {"1", "2"} and "rejection sampler alone" in stdout
    for figures in payload["sampler"].values():
        assert set(figures) == {"one_hot_ms", "draft_probs_ms", "greedy_ms"} and min(figures.values()) > 0


def test_bench_spec_decode_smollm2_only(tmp_path, smollm2_dir):
    """--smollm2-only: SmolLM2 on the copy-heavy chat prompts, with and without n-gram drafts, and how
    many texts are identical (all of them in float32), nothing else."""
    from benchmarks.bench_spec_decode import COPY_TASKS

    payload, stdout = run_benchmark("bench_spec_decode", tmp_path, "--smollm2-only", "--smollm2-output-len", "8",
                                    "--trace", png=False)
    assert "spec" not in payload
    spec = payload["smollm2"]["ngram k=2"]
    assert spec["num_drafts"] > 0 and spec["acceptance_length"] > 1 and spec["speedup"] > 0
    # the trace over every prompt: one prefill each, and as many verify steps as drafts at batch 1
    none_trace = payload["smollm2"]["none"]["trace"]
    assert none_trace["prefill"]["steps"] == len(COPY_TASKS) and "verify" not in none_trace
    assert spec["trace"]["verify"]["steps"] == spec["num_drafts"]
    if payload["options"]["dtype"] == "float32":
        assert spec["same_text_as_none"] and spec["prompts_with_same_text"] == len(COPY_TASKS)
        assert spec["agreement"] == 1.0
    assert f"/{len(COPY_TASKS)} prompts, agreement" in stdout


def test_bench_moe_cpu_smoke(tmp_path):
    """The MoE benchmark on tiny experts: every provider that runs is checked against the reference and
    timed, its FLOPs follow the formula, and the naive loop's speedup is its time over ours."""
    payload, stdout = run_benchmark("bench_moe", tmp_path)
    check_environment(payload, "bench_moe")
    shape, rows = payload["shape"], payload["results"]
    assert {r["M"] for r in rows} == {1, 7, 33}
    for M in (1, 7, 33):
        providers = {r["provider"]: r for r in rows if r["M"] == M}
        assert providers["ours"]["status"] == "ok" and providers["naive"]["status"] == "ok"
        ours = providers["ours"]
        assert ours["flops"] == 2 * M * shape["top_k"] * 3 * shape["intermediate_size"] * shape["hidden_size"]
        assert ours["ms"] > 0 and ours["max_abs_err"] < (1e-3 if payload["options"]["dtype"] == "float32" else 3e-2)
    assert "Fused MoE" in stdout


def test_engine_args_take_a_json_object_and_refuse_anything_else(capsys):
    """--engine-args (every script that builds engines): a JSON object of LLM(...) keyword arguments; a
    list or broken JSON is a usage error that names the option."""
    import argparse

    from benchmarks.common import add_engine_args

    parser = add_engine_args(argparse.ArgumentParser())
    assert parser.parse_args([]).engine_args == {}
    assert parser.parse_args(["--engine-args", '{"small_batch_gemv": true}']).engine_args == {"small_batch_gemv": True}
    for bad in ("[1]", "{x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--engine-args", bad])
        assert "--engine-args" in capsys.readouterr().err
