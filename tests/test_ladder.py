"""The course's ladder (benchmarks/bench_ladder.py): its CPU smoke run reports every rung, and each
stage's engine, built from that rung's options alone, generates transformers' greedy tokens, so a
learner who stops after any chapter has a working engine of that stage."""
import random

import pytest
import torch
from hf_reference import hf_greedy
from test_benchmarks import check_environment, run_benchmark

from benchmarks.bench_ladder import RUNGS, engine_options
from minivllm import LLM, SamplingParams

ON_GPU = torch.cuda.is_available()
# Rung 4 (CUDA graphs) captures nothing on a CPU: its engine is rung 3's, so it has no case of its own.
CPU_STAGES = [rung for rung in RUNGS[1:] if not rung.needs_cuda]
NUM_NEW_TOKENS = 3


def test_ladder_cpu_smoke_reports_every_rung(tmp_path):
    payload, stdout = run_benchmark("bench_ladder", tmp_path, timeout=300)
    check_environment(payload, "bench_ladder")
    assert payload["complete"] is True  # (the file is written after every rung; the last write is whole)
    assert stdout.count("wrote ") >= 8
    rows = payload["rungs"]
    assert [r["rung"] for r in rows] == [r.number for r in RUNGS] == list(range(8))
    assert [r["chapter"] for r in rows] == [r.chapter for r in RUNGS]
    for row in rows:
        assert row["status"] in ("ok", "skipped"), row
        if row["status"] == "skipped":
            assert row["reason"].startswith("skipped: "), row
    skipped = {r["rung"] for r in rows if r["status"] == "skipped"}
    assert skipped == (set() if payload["environment"]["cuda"] else {4}), skipped
    assert "needs CUDA" in rows[4].get("reason", "needs CUDA")
    ok = [r for r in rows if r["status"] == "ok"]
    base = rows[0]["output_tok_per_s"]
    requested = payload["workload"]["output_tokens"]
    for row in ok:
        assert row["output_tok_per_s"] > 0 and row["seconds"] > 0
        assert row["ratio_to_baseline"] == pytest.approx(row["output_tok_per_s"] / base)
        assert row["output_tokens"] == requested and row["output_tokens_match_requested"], row
    assert payload["checks"]["token_counts_equal"]
    if not payload["environment"]["cuda"]:  # float32: exact; in bfloat16 a near-tie may tip (reported, not asserted)
        assert payload["checks"]["engine_greedy_outputs_equal"], [r.get("greedy_mismatched_requests") for r in ok]
        assert all(r["greedy_mismatched_requests"] == [] for r in ok if r["rung"] != 1)
        assert payload["checks"]["baseline_greedy_equal_to_rung_1"] == "3/3"
    assert "x rung 0" in stdout.strip().splitlines()[-len(rows) - 2]  # the table is printed last


def test_engine_options_are_cumulative():
    assert engine_options(1) == dict(attention_backend="torch", enforce_eager=True, enable_prefix_caching=False,
                                     async_scheduling=False, enable_chunked_prefill=False, compile_small_ops=False)
    for rung in RUNGS[2:]:  # each rung changes exactly what it adds
        before, after = engine_options(rung.number - 1), engine_options(rung.number)
        assert {k for k in after if after[k] != before[k]} == set(rung.adds)
    last = engine_options(len(RUNGS) - 1)
    assert last == dict(attention_backend="triton", enforce_eager=False, enable_prefix_caching=True,
                        async_scheduling=True, enable_chunked_prefill=True, compile_small_ops=True)


@pytest.fixture(scope="module")
def prompts_and_reference(qwen3_tiny_dir):
    """Two prompts whose total (37 tokens) exceeds the stages' 32-token budget (chunked prefill splits
    the second), and transformers' greedy tokens for them."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (11, 26)]
    return prompts, hf_greedy(qwen3_tiny_dir, prompts, NUM_NEW_TOKENS)


@pytest.mark.parametrize("rung", [pytest.param(r, marks=pytest.mark.skipif(
    ON_GPU and r.needs_triton, reason="Triton on CPU tensors needs TRITON_INTERPRET, set on CPU-only machines"))
    for r in CPU_STAGES], ids=lambda r: f"rung{r.number}")
def test_stage_engine_matches_transformers(qwen3_tiny_dir, prompts_and_reference, rung):
    prompts, expected = prompts_and_reference
    options = engine_options(rung.number)
    llm = LLM(qwen3_tiny_dir, device="cpu", dtype="float32", max_model_len=32, max_num_batched_tokens=32,
              max_num_seqs=4, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert {k: getattr(llm.config, k) for k in options} == options  # the stage is the engine that ran
        if options["enable_prefix_caching"]:  # the second prompt again: its first 16-token block is a hit
            again = llm.generate(prompts[1:], params, use_tqdm=False)
            assert list(again[0].outputs[0].token_ids) == expected[1]
            assert llm.scheduler.kv_cache_manager.num_cached_tokens_hit >= 16
    finally:
        llm.shutdown()
