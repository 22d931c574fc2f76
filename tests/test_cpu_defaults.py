"""Defaults of the CPU path: a KV cache no larger than the engine can fill, and torch's thread pool
leaving a core for the engine's loop unless the user chose a thread count."""
import logging
import os

import pytest
import torch

from minivllm import LLM
from minivllm.engine import assemble
from minivllm.engine.assemble import leave_a_core_free

SMALL_ENGINE = dict(device="cpu", max_model_len=64, max_num_batched_tokens=128)


def test_kv_cache_sized_for_max_num_seqs_of_max_model_len(qwen3_tiny_dir):
    llm = LLM(qwen3_tiny_dir, max_num_seqs=3, **SMALL_ENGINE)
    blocks_per_seq = -(-(64 + 1) // llm.config.kvcache_block_size)  # room for the token being decoded
    assert llm.config.num_kvcache_blocks == 3 * blocks_per_seq
    assert llm.model_runner.kv_cache.shape[2] == 3 * blocks_per_seq
    assert 3 * blocks_per_seq * llm.model_runner.kv_cache_block_bytes() < llm.config.cpu_kvcache_space_bytes


def test_kv_cache_budget_wins_when_smaller(qwen3_tiny_dir):
    probe = LLM(qwen3_tiny_dir, max_num_seqs=1, **SMALL_ENGINE)
    block_bytes = probe.model_runner.kv_cache_block_bytes()
    llm = LLM(qwen3_tiny_dir, max_num_seqs=64, cpu_kvcache_space_bytes=7 * block_bytes + 1, **SMALL_ENGINE)
    assert llm.config.num_kvcache_blocks == 7
    explicit = LLM(qwen3_tiny_dir, max_num_seqs=64, num_kvcache_blocks=9, **SMALL_ENGINE)
    assert explicit.config.num_kvcache_blocks == 9


def test_an_engine_owns_its_state(qwen3_tiny_dir):
    """Building an engine does not reseed torch's global RNG or write the runner's config; unseeded
    sampling draws from the engine's own generator, so two engines with one seed agree whatever the
    application draws in between."""
    from minivllm import SamplingParams

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    first = LLM(qwen3_tiny_dir, max_num_seqs=2, seed=5, **SMALL_ENGINE)
    assert torch.equal(torch.rand(4), expected)
    assert first.model_runner.config.num_kvcache_blocks is None  # what the caller asked for: sized from memory
    assert first.config.num_kvcache_blocks == first.model_runner.num_kvcache_blocks > 0
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    tokens = first.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids
    second = LLM(qwen3_tiny_dir, max_num_seqs=2, seed=5, **SMALL_ENGINE)
    torch.rand(1000)  # the application draws from the global generator
    assert second.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids == tokens


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")
@pytest.mark.parametrize("num_cores, num_ranks, threads_before, threads_after",
                         [(4, 1, 4, 3), (2, 1, 2, 1), (4, 1, 2, 2), (1, 1, 1, 1), (16, 2, 16, 7), (2, 2, 2, 1)])
def test_threads_leave_a_core_free(monkeypatch, restore_threads, caplog, num_cores, num_ranks, threads_before,
                                   threads_after):
    """All cores but one, split between the tensor-parallel ranks (one process each)."""
    monkeypatch.setattr(assemble.os, "sched_getaffinity", lambda pid: set(range(num_cores)))
    torch.set_num_threads(threads_before)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        leave_a_core_free(num_ranks)
    assert torch.get_num_threads() == threads_after
    changed = [r.getMessage() for r in caplog.records if "set_num_threads" in r.getMessage()]
    assert len(changed) == (threads_after != threads_before)  # a change is always logged, and only a change
    if changed:
        assert f"set_num_threads({threads_after}) (was {threads_before} on {num_cores} cores, {num_ranks} rank" in changed[0]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity")
@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_threads_chosen_by_the_user_are_kept(monkeypatch, restore_threads, variable):
    monkeypatch.setattr(assemble.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setenv(variable, "4")
    torch.set_num_threads(4)
    leave_a_core_free()
    assert torch.get_num_threads() == 4


def test_engine_on_cpu_applies_it(qwen3_tiny_dir, monkeypatch, restore_threads):
    calls = []
    monkeypatch.setattr(assemble, "leave_a_core_free", lambda num_ranks: calls.append(num_ranks))
    LLM(qwen3_tiny_dir, max_num_seqs=1, **SMALL_ENGINE)
    assert calls == [1]
