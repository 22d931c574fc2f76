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


def run_benchmark(name, out_dir, *extra, timeout=240):
    # Tiny sizes on whatever device there is: the GPU (bfloat16) on a CUDA machine, else the CPU
    # (float32) with the Triton kernels in the interpreter. Tolerances and byte counts follow the dtype.
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--cpu-smoke", "--out-dir", str(out_dir),
                           *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((out_dir / f"{name}.json").read_text())
    if importlib.util.find_spec("matplotlib"):
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
    assert set(by_case) == {"1x64", "2x32", "mixed(3 seqs,48 tok)", "prefix-hit 2x32"}
    for case, providers in by_case.items():
        assert set(providers) == {"ours", "naive", "sdpa_flash", "sdpa_cudnn"}, case
        for provider in ("ours", "naive"):  # the naive version and ours must always run here
            row = providers[provider]
            assert row["status"] == "ok", (row.get("error"), row)
            assert row["max_abs_err"] < max_err and row["ms"] > 0
            assert row["TFLOPs"] == pytest.approx(row["flops"] / (row["ms"] * 1e-3) / 1e12)
        assert providers["ours"]["ours_speedup"] == pytest.approx(1.0)
    # causal FLOPs = 2*B*H*S^2*D with all tokens new; prefix hit: 4*H*D*(Sq*(Sk-Sq) + Sq^2/2) per sequence
    assert by_case["1x64"]["ours"]["flops"] == 2 * 1 * heads * 64**2 * head_dim
    assert by_case["2x32"]["ours"]["flops"] == 2 * 2 * heads * 32**2 * head_dim
    assert by_case["prefix-hit 2x32"]["ours"]["flops"] == 2 * 4 * heads * head_dim * (16 * 16 + 16**2 / 2)
    assert "ours speedup" in stdout.strip().splitlines()[-len(rows) - 2]  # the table is printed last


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
    ours = ("ours", "ours_fp8") + (("ours_graph", "ours_fp8_graph") if torch.cuda.is_available() else ())
    expected = {(case, p, bs) for case in ("1x80", "3x48") for p in ours + ("naive",) for bs in opts["block_sizes"]}
    expected |= {(case, f"sdpa_{b}", None) for case in ("1x80", "3x48") for b in ("flash", "cudnn")}
    assert seen == expected
    assert "ours speedup" in stdout


def test_throughput_workload_is_nano_vllms():
    """The 256-request draw gives the 133,966 output tokens of benchmarks/README.md (nano-vllm's bench.py procedure)."""
    from benchmarks.bench_throughput import make_workload

    prompts, output_lens = make_workload(256, 100, 1024, 10000, seed=0)
    assert sum(output_lens) == 133_966 and sum(map(len, prompts)) == 142_827
    assert min(map(min, prompts)) >= 0 and max(map(max, prompts)) <= 10000
    assert all(100 <= n <= 1024 for n in output_lens + [len(p) for p in prompts])


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


def test_bench_throughput_tiny(tmp_path):
    """Both engines on 4 short requests of qwen3-tiny (the LLM API and make_model must exist)."""
    pytest.importorskip("minivllm.llm", reason="minivllm.llm (the LLM API) does not exist yet")
    pytest.importorskip("minivllm.tools.make_model", reason="minivllm.tools.make_model does not exist yet")
    payload, stdout = run_benchmark("bench_throughput", tmp_path, "--model-cache", str(tmp_path / "models"),
                                    "--kv-cache-dtype", "auto", "fp8", timeout=400)
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
    runs, floors = payload["minivllm_by_kv_cache_dtype"], payload["floor_by_kv_cache_dtype"]
    assert runs["auto"] == payload["minivllm"] and runs["fp8"]["kv_cache_dtype"] == "fp8"
    assert runs["fp8"]["engine"]["kv_cache_torch_dtype"] == "torch.float8_e4m3fn"
    assert runs["fp8"]["output_tokens"] == work["output_tokens"]
    assert floors["fp8"]["kv_bytes_per_context_token"] * ITEMSIZE[payload["options"]["dtype"]] == (
        floors["auto"]["kv_bytes_per_context_token"])
    assert payload["ratio_fp8_kv_over_auto_output_tok_per_s"] == pytest.approx(
        runs["fp8"]["output_tok_per_s"] / runs["auto"]["output_tok_per_s"])
