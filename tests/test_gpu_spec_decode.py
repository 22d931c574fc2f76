"""Speculative decoding on a GPU: the engine's defaults there (Triton kernels, CUDA graphs for the
decode and the draft steps, async scheduling), greedy outputs token for token the same with and
without drafts, n-gram and draft model, in float32 (in bfloat16 the verify step's GEMMs over k + 1
rows round differently from a one-row decode and flip a random model's near-ties:
benchmarks/README.md, "Speculative decoding", reports that agreement).
The CPU tests (tests/test_spec_decode_engine.py) cover each scenario on the torch backend."""
import pytest
import torch

from test_spec_decode_engine import NGRAM, copy_heavy_prompts, draft_spec, generate, greedy, spec_stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ON_GPU = dict(device="cuda", dtype="float32", num_kvcache_blocks=512)


def run(model_dir, prompts, params, spec=None, check=None, **kwargs):
    return generate(model_dir, prompts, params, spec, check, **{**ON_GPU, **kwargs})


def test_gpu_engine_runs_with_its_graphs_and_async_scheduling(qwen3_tiny_dir):
    """The layers these tests mean to exercise are on: decode graphs, async scheduling, Triton attention."""
    def check(llm):
        assert llm.config.async_scheduling and not llm.config.enforce_eager
        assert llm.config.attention_backend == "triton"
        assert spec_stats(llm).num_drafts > 0
    run(qwen3_tiny_dir, copy_heavy_prompts(2), greedy(20), NGRAM, check)


def test_gpu_ngram_same_tokens_copy_heavy_random_preemption_prefix_hits(qwen3_tiny_dir):
    prompts = copy_heavy_prompts(6)
    for args in ({}, dict(num_kvcache_blocks=30, max_model_len=128), dict(max_num_batched_tokens=24)):
        def check(llm, args=args):
            assert spec_stats(llm).num_accepted_tokens > 0
            if "num_kvcache_blocks" in args:
                assert llm.scheduler.num_preemptions > 0
        plain = run(qwen3_tiny_dir, prompts, greedy(60), **args)
        assert run(qwen3_tiny_dir, prompts, greedy(60), NGRAM, check, **args) == plain, args
    shared = copy_heavy_prompts(2, seed=3)[0]
    prompts = [shared + p for p in copy_heavy_prompts(5, seed=4)]
    plain = run(qwen3_tiny_dir, prompts, greedy(30))
    assert run(qwen3_tiny_dir, prompts, greedy(30), NGRAM) == plain


def test_gpu_ngram_stops_max_tokens_and_n_2(qwen3_tiny_dir):
    prompts = copy_heavy_prompts(5, seed=5)
    reference = run(qwen3_tiny_dir, prompts, greedy(40))
    params = [greedy(40, stop_token_ids=[r[0][0][6]]) for r in reference] + [greedy(n) for n in (1, 2, 3, 5, 9)]
    assert run(qwen3_tiny_dir, prompts + prompts, params, NGRAM) == run(qwen3_tiny_dir, prompts + prompts, params)
    assert run(qwen3_tiny_dir, prompts, greedy(30, n=2), NGRAM) == run(qwen3_tiny_dir, prompts, greedy(30, n=2))


def test_gpu_draft_model_same_tokens(qwen3_tiny_dir, llama_tiny_dir):
    """The target as its own draft keeps the target's tokens and has nearly every draft accepted
    (float32 sums over 1 and k + 1 rows may still differ in the last bits); a Llama draft is often
    wrong and the outputs are still the target's."""
    prompts = copy_heavy_prompts(6, seed=21)
    plain = run(qwen3_tiny_dir, prompts, greedy(40))

    def mostly_accepted(llm):
        stats = spec_stats(llm)
        assert stats.num_drafts > 20 and stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    assert run(qwen3_tiny_dir, prompts, greedy(40), draft_spec(qwen3_tiny_dir), mostly_accepted) == plain
    assert run(qwen3_tiny_dir, prompts, greedy(40), draft_spec(llama_tiny_dir)) == plain
