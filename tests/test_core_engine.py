"""The core alone (minivllm/core/: no layer of minivllm/engine/) is an engine: eager, torch or
Triton attention, the core sampler. Greedy tokens equal transformers', prefix caching and
preemption change no output, and what the core leaves to the layers is an error, not ignored."""
import random
from dataclasses import replace

import pytest
from hf_reference import hf_greedy

from conftest_kernels import needs_interpreter
from minivllm.config import Config
from minivllm.core.engine import Engine
from minivllm.core.model_runner import ModelRunner
from minivllm.core.scheduler import Scheduler
from minivllm.engine.chunked_prefill import ChunkedPrefillScheduler
from minivllm.sampling_params import SamplingParams

ARGS = dict(device="cpu", max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8, kvcache_block_size=8)


def core_engine(model_dir, scheduler_class=Scheduler, **kwargs) -> Engine:
    config = Config(model_dir, **{**ARGS, **kwargs})
    runner = ModelRunner(config)
    assert type(runner) is ModelRunner  # no layer
    return Engine(scheduler_class(replace(config, num_kvcache_blocks=runner.num_kvcache_blocks)), runner)


def random_prompts(num, min_len, max_len, seed=0, vocab=1000):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)  # min_tokens as transformers' min_new_tokens


@pytest.mark.parametrize("model_fixture", ["qwen3_tiny_dir", "llama_tiny_dir"])
def test_core_greedy_matches_transformers(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(6, 1, 120)
    assert core_engine(model_dir).generate(prompts, greedy(16)) == hf_greedy(model_dir, prompts, 16)


@needs_interpreter
def test_core_with_the_triton_kernels_matches_the_torch_references(qwen3_tiny_dir):
    prompts = random_prompts(3, 5, 40, seed=1)
    torch_tokens = core_engine(qwen3_tiny_dir).generate(prompts, greedy(6))
    assert core_engine(qwen3_tiny_dir, attention_backend="triton").generate(prompts, greedy(6)) == torch_tokens


def test_core_prefix_caching_and_chunks_change_no_output(qwen3_tiny_dir):
    """Chunks: chapter 11's scheduler (a layer) over the core's runner, which computes any chunk."""
    shared = random_prompts(1, 60, 60, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 20, seed=3)]
    outputs = {}
    for caching, chunked in ((False, False), (True, False), (True, True)):
        engine = core_engine(qwen3_tiny_dir, ChunkedPrefillScheduler if chunked else Scheduler,
                             enable_prefix_caching=caching, max_num_batched_tokens=24 if chunked else 512)
        outputs[caching, chunked] = engine.generate(prompts[:1], greedy(8)) + engine.generate(prompts[1:], greedy(8))
        hits = engine.scheduler.kv_cache_manager.num_cached_tokens_hit
        assert (hits >= 3 * 56) == caching, hits  # each later prompt finds the shared 7 blocks of 8
    assert outputs[True, False] == outputs[False, False] == outputs[True, True]


def test_core_preemption_changes_no_output_and_frees_every_block(qwen3_tiny_dir):
    prompts = random_prompts(6, 20, 60, seed=4)
    expected = core_engine(qwen3_tiny_dir).generate(prompts, greedy(40))
    small = core_engine(qwen3_tiny_dir, max_model_len=104, num_kvcache_blocks=14)
    assert small.generate(prompts, greedy(40)) == expected
    assert small.scheduler.num_preemptions > 0
    kv = small.scheduler.kv_cache_manager
    assert kv.num_free_blocks == 14 and all(b.ref_count == 0 for b in kv.pool.blocks.values())


def test_core_samples_with_temperature_top_k_top_p(qwen3_tiny_dir):
    engine = core_engine(qwen3_tiny_dir)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=8, ignore_eos=True)
    first, second = (engine.generate([[1, 2, 3]] * 4, params) for _ in range(2))
    assert all(len(t) == 8 for t in first) and first != second  # fresh noise from the engine's generator


@pytest.mark.parametrize("params, what", [(dict(seed=1), "seed"), (dict(presence_penalty=0.5), "penalties"),
                                          (dict(logprobs=1), "logprobs"), (dict(stop=["x"]), "stop strings")])
def test_core_refuses_what_its_layers_do(qwen3_tiny_dir, params, what):
    with pytest.raises(ValueError, match=f"the core engine does not do .*{what}"):
        core_engine(qwen3_tiny_dir).generate([[1, 2, 3]], SamplingParams(max_tokens=2, **params))
