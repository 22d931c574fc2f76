"""Chapter 00's baseline (minivllm/baseline.py): a padded static batch over a contiguous KV cache
gives, token for token, the engine's greedy output and transformers' greedy generate.

Everything is pinned to the CPU in float32 (also on a CUDA machine): exact parity needs it."""
import random

import pytest
import torch
from hf_reference import hf_greedy

from minivllm import LLM, SamplingParams, baseline

NUM_NEW_TOKENS = 24


def random_prompts(lengths, vocab_size, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("model_fixture", ["qwen3_tiny_dir", "llama_tiny_dir"])
def test_baseline_greedy_equals_engine_and_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    model, _ = baseline.load(model_dir, dtype=torch.float32, device="cpu")
    # ragged lengths: the batch is left-padded by up to 150 tokens
    prompts = random_prompts([1, 7, 33, 151], model.config.vocab_size)
    ours = baseline.generate(model, prompts, NUM_NEW_TOKENS)  # no EOS: every prompt runs to the end
    with LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=512,
             num_kvcache_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
        engine = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    expected = hf_greedy(model_dir, prompts, NUM_NEW_TOKENS)
    for prompt, mine, theirs, hf in zip(prompts, ours, engine, expected):
        assert len(mine) == NUM_NEW_TOKENS
        assert mine == theirs, f"prompt of {len(prompt)} tokens: baseline and engine diverged"
        assert mine == hf, f"prompt of {len(prompt)} tokens: baseline and transformers diverged"


def test_padding_does_not_change_a_sequence(qwen3_tiny_dir):
    """Each prompt alone (no padding) and in a batch padded to a much longer one: same tokens."""
    model, _ = baseline.load(qwen3_tiny_dir)
    prompts = random_prompts([3, 90], model.config.vocab_size, seed=1)
    batched = baseline.generate(model, prompts, 8)
    alone = [baseline.generate(model, [p], 8)[0] for p in prompts]
    assert batched == alone


def test_stops_at_eos_and_keeps_the_eos_token(qwen3_tiny_dir):
    model, _ = baseline.load(qwen3_tiny_dir)
    prompt = random_prompts([12], model.config.vocab_size, seed=2)
    full = baseline.generate(model, prompt, 10)[0]
    eos = full[3]  # pretend the fourth generated token is the model's EOS
    cut = baseline.generate(model, prompt, 10, eos_token_id=eos)[0]
    assert cut == full[:full.index(eos) + 1]


def test_max_tokens_per_prompt(qwen3_tiny_dir):
    """Each sequence stops at its own max_tokens; the batch runs until the longest is done."""
    model, _ = baseline.load(qwen3_tiny_dir)
    prompts = random_prompts([4, 20, 11], model.config.vocab_size, seed=4)
    full = baseline.generate(model, prompts, 9)
    assert baseline.generate(model, prompts, [2, 9, 5]) == [full[0][:2], full[1], full[2][:5]]


def test_temperature_sampling_is_seeded(qwen3_tiny_dir):
    model, _ = baseline.load(qwen3_tiny_dir)
    prompts = random_prompts([5, 9], model.config.vocab_size, seed=3)
    first = baseline.generate(model, prompts, 12, temperature=1.0, seed=7)
    assert first == baseline.generate(model, prompts, 12, temperature=1.0, seed=7)
    assert first != baseline.generate(model, prompts, 12, temperature=1.0, seed=8)
    assert first != baseline.generate(model, prompts, 12)  # not greedy in disguise


@pytest.mark.parametrize("bad", [dict(prompts=[]), dict(prompts=[[]]), dict(max_tokens=0), dict(max_tokens=[4, 4]),
                                 dict(temperature=-1.0)])
def test_bad_input_is_an_error(qwen3_tiny_dir, bad):
    model, _ = baseline.load(qwen3_tiny_dir)
    args = dict(prompts=[[1, 2, 3]], max_tokens=4, temperature=0.0) | bad
    with pytest.raises(ValueError):
        baseline.generate(model, **args)


def test_bench_baseline_smoke(capsys):
    """The chapter's measurement runs end to end on the CPU and finds the two outputs equal."""
    from benchmarks import bench_baseline

    bench_baseline.main(["--device", "cpu", "--num-requests", "3", "--min-len", "4", "--max-len", "9"])
    out = capsys.readouterr().out
    assert "greedy outputs identical: 3/3 requests" in out
    assert "baseline prefill tokens" in out and "output tokens/s" in out
