"""Tensor parallelism on the CPU (gloo, two ranks, four in one test): the same logits and tokens as
one rank, prefix caching and preemption across ranks, chunked prefill (mixed steps, prompt logprobs)
under async scheduling, FP8 weights and KV cache, the shards each rank loads, and the worker
processes' life cycle (shutdown, garbage collection, a killed worker, a killed or interrupted parent)."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from benchmarks.common import teacher_forced_logits
from minivllm import LLM, SamplingParams
from minivllm.engine import logprobs
from minivllm.engine.executor import WorkerDiedError
from minivllm.engine.mixed_steps import SplitMixedMetadata
from minivllm.layers.context import ModelContext
from minivllm.models.loader import build_model

# 14 blocks of 8 tokens: six sequences of up to 100 tokens cannot all stay, so the scheduler preempts
# device="cpu": these are the gloo tests, also on a machine with GPUs
ENGINE_ARGS = dict(device="cpu", max_model_len=104, max_num_batched_tokens=512, max_num_seqs=8, kvcache_block_size=8,
                   num_kvcache_blocks=14)
REPO_ROOT = Path(__file__).resolve().parents[1]
EXIT_TIMEOUT_S = 15  # a worker process must be gone this long after its engine is


def prompts(num, min_len, max_len, seed=0, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def tokens(llm, batch, max_tokens):
    return [o.outputs[0].token_ids for o in llm.generate(batch, greedy(max_tokens), use_tqdm=False)]


def wait_gone(pids, timeout=EXIT_TIMEOUT_S):
    """The pids still running (zombies count as gone) after waiting up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_heads_not_divisible_is_a_clear_error(qwen3_tiny_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide .*num_attention_heads=8"):
        LLM(qwen3_tiny_dir, device="cpu", tensor_parallel_size=3)


def spawned_children():
    return [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_startup_error_is_raised_as_is_and_leaves_no_worker(qwen3_tiny_dir):
    """Every rank finds the KV cache too small: rank 0 raises that error, not a worker's exit."""
    with pytest.raises(ValueError, match="one sequence of max_model_len=512 needs 32"):
        LLM(qwen3_tiny_dir, device="cpu", tensor_parallel_size=2, max_model_len=512, num_kvcache_blocks=8)
    assert wait_gone([p.pid for p in spawned_children()]) == []


def test_each_rank_loads_its_shard(llama_tiny_dir):
    """Rank r holds rows r/N of the column-parallel weights, columns r/N of the row-parallel ones, and
    each KV head on tp_size / num_kv_heads ranks when there are more ranks than KV heads."""
    full = dict(build_model(llama_tiny_dir).named_parameters())
    hf_kv_heads, head_dim = 2, 32
    for tp_size in (2, 4):
        for rank in range(tp_size):
            shard = dict(build_model(llama_tiny_dir, ctx=ModelContext(rank, tp_size)).named_parameters())
            name = "model.layers.0.self_attn."
            q_rows = full[name + "qkv_proj.weight"].shape[0] - 2 * hf_kv_heads * head_dim
            q, k, v = full[name + "qkv_proj.weight"].split([q_rows, hf_kv_heads * head_dim, hf_kv_heads * head_dim])
            kv_heads = max(1, hf_kv_heads // tp_size)
            kv_head = rank * hf_kv_heads // tp_size  # 4 ranks, 2 heads: ranks 0, 1 -> head 0; ranks 2, 3 -> head 1
            expected = torch.cat([q.chunk(tp_size)[rank], k[kv_head * head_dim:(kv_head + kv_heads) * head_dim],
                                  v[kv_head * head_dim:(kv_head + kv_heads) * head_dim]])
            torch.testing.assert_close(shard[name + "qkv_proj.weight"], expected, rtol=0, atol=0)
            torch.testing.assert_close(shard[name + "o_proj.weight"],
                                       full[name + "o_proj.weight"].chunk(tp_size, dim=1)[rank], rtol=0, atol=0)
            gate, up = full["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
            torch.testing.assert_close(shard["model.layers.0.mlp.gate_up_proj.weight"],
                                       torch.cat([gate.chunk(tp_size)[rank], up.chunk(tp_size)[rank]]), rtol=0, atol=0)
            torch.testing.assert_close(shard["lm_head.weight"], full["lm_head.weight"].chunk(tp_size)[rank],
                                       rtol=0, atol=0)


@pytest.fixture(scope="class")
def qwen3_tp2(qwen3_tiny_dir):
    """One two-rank engine for the parity, prefix-caching and preemption tests; async scheduling on
    (its reference, one rank, runs synchronously)."""
    llm = LLM(qwen3_tiny_dir, tensor_parallel_size=2, async_scheduling=True, **ENGINE_ARGS)
    yield llm
    llm.shutdown()  # before the next test starts its own: one tensor-parallel engine per process at a time


@pytest.fixture(scope="module")
def qwen3_tp1(qwen3_tiny_dir):
    return LLM(qwen3_tiny_dir, **ENGINE_ARGS)


class TestQwen3TwoRanks:
    def test_logits_and_greedy_tokens_match_one_rank(self, qwen3_tp2, qwen3_tp1):
        batch = prompts(5, 1, 60, seed=1)
        one, two = teacher_forced_logits(qwen3_tp1, batch), teacher_forced_logits(qwen3_tp2, batch)
        assert one.keys() == two.keys()
        for key, logits in one.items():
            torch.testing.assert_close(two[key], logits, rtol=1e-4, atol=1e-4, msg=f"(step, prompt) {key}")
        assert tokens(qwen3_tp2, batch, 12) == tokens(qwen3_tp1, batch, 12)


    def test_prefix_caching_under_tensor_parallelism(self, qwen3_tp2, qwen3_tp1):
        shared = prompts(1, 40, 40, seed=2)[0]  # 5 full blocks of 8
        batch = [shared + tail for tail in prompts(3, 2, 10, seed=3)]
        expected = tokens(qwen3_tp1, batch, 6)
        assert qwen3_tp2.reset_prefix_cache()
        first = qwen3_tp2.generate(batch[:1], greedy(6), use_tqdm=False)
        rest = qwen3_tp2.generate(batch[1:], greedy(6), use_tqdm=False)
        assert [o.num_cached_tokens for o in rest] == [40, 40]
        assert [o.outputs[0].token_ids for o in first + rest] == expected


    def test_logprobs_and_penalties_match_one_rank(self, qwen3_tp2, qwen3_tp1):
        """Rank 0 holds the gathered logits: logprobs and penalties work as on one rank."""
        batch = prompts(3, 5, 30, seed=8)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, repetition_penalty=1.3)
        one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (qwen3_tp1, qwen3_tp2))
        for a, b in zip(one, two):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)
        params = SamplingParams(max_tokens=2, prompt_logprobs=2)
        one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (qwen3_tp1, qwen3_tp2))
        assert_same_prompt_logprobs(one, two)

    def test_preemption_under_tensor_parallelism(self, qwen3_tp2, qwen3_tp1):
        batch = prompts(6, 20, 60, seed=4)
        before = qwen3_tp2.scheduler.num_preemptions
        assert tokens(qwen3_tp2, batch, 40) == tokens(qwen3_tp1, batch, 40)
        assert qwen3_tp2.scheduler.num_preemptions > before
        assert qwen3_tp2.scheduler.kv_cache_manager.num_free_blocks == ENGINE_ARGS["num_kvcache_blocks"]


def assert_same_prompt_logprobs(one, two):
    for a, b in zip(one, two):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for token_id in pa:
                assert pb[token_id].logprob == pytest.approx(pa[token_id].logprob, abs=1e-3)


# A 24-token budget splits the prompts across steps and mixes decode rows with prompt chunks.
CHUNKED_ARGS = {**ENGINE_ARGS, "max_num_batched_tokens": 24, "enable_chunked_prefill": True}


@dataclass
class SentStep:
    """What rank 0 told the workers about one prefill or mixed step (the StepInputs it sent), and how
    it attended (every rank packs the same inputs the same way)."""

    num_decodes: int  # decode rows, split (their own metadata) or unified (1-token chunks)
    unified: bool
    num_chunks: int
    has_block_tables: bool  # a chunk continues a cached prefix (an earlier chunk or a prefix-cache hit)
    num_logits_rows: int
    prompt_logprob_pieces: list[tuple[int, int]]


def record_sent_steps(llm) -> list[SentStep]:
    runner, steps, uploaded = llm.model_runner, [], {}
    send, upload = runner.channel.send, runner.upload

    def recording_upload(inputs):  # rank 0 uploads a step, then sends it as its forward begins
        uploaded["attn"] = upload(inputs)
        return uploaded["attn"]

    def recording_send(inputs):
        if inputs is not None and inputs.is_prefill:
            d = inputs.num_decodes
            new = np.diff(inputs.cu_seqlens_q)[d:]  # the chunks' rows
            cached_prefix = np.diff(inputs.cu_seqlens_k)[d:] > new
            split = isinstance(uploaded["attn"].attn, SplitMixedMetadata)
            steps.append(SentStep(d, bool(d) and not split, len(new), bool(cached_prefix.any()),
                                  len(inputs.logits_indices), [tuple(p) for p in inputs.prompt_logprob_pieces.tolist()]))
        send(inputs)

    runner.channel.send, runner.upload = recording_send, recording_upload
    return steps


@pytest.fixture(scope="class", params=["split", "unified"])
def chunked_tp2(qwen3_tiny_dir, request):
    """Two ranks, chunked prefill with a small budget, async scheduling on, mixed steps' decode rows
    through the decode kernel (split) or as 1-token chunks (unified); `sent_steps` records the
    prefill and mixed steps the workers receive."""
    llm = LLM(qwen3_tiny_dir, tensor_parallel_size=2, async_scheduling=True, mixed_step_attention=request.param,
              **CHUNKED_ARGS)
    assert llm.config.enable_chunked_prefill and llm.config.mixed_step_attention == request.param
    llm.sent_steps = record_sent_steps(llm)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chunked_tp1(qwen3_tiny_dir):
    with LLM(qwen3_tiny_dir, **CHUNKED_ARGS) as llm:
        yield llm


@pytest.fixture
def sent_steps(chunked_tp2):
    chunked_tp2.sent_steps.clear()
    return chunked_tp2.sent_steps


def same_prefix_cache_state(*llms):
    for llm in llms:
        assert llm.reset_prefix_cache()


class TestChunkedPrefillTwoRanks:
    """The workers rebuild each mixed step's attention metadata and compute the LM-head shard of
    exactly the rows rank 0 asks for; every test compares with one rank, token for token."""

    def test_mixed_steps_match_one_rank(self, chunked_tp2, chunked_tp1, sent_steps):
        batch = prompts(5, 20, 70, seed=11)
        one, two = teacher_forced_logits(chunked_tp1, batch, 8), teacher_forced_logits(chunked_tp2, batch, 8)
        assert one.keys() == two.keys()
        for key, logits in one.items():
            torch.testing.assert_close(two[key], logits, rtol=1e-4, atol=1e-4, msg=f"(step, prompt) {key}")
        # then three short prompts (different lengths: the decode rows' seq_order is not the identity)
        # that decode beside the chunks of a long one
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        short = prompts(3, 8, 8, seed=16)
        for batch in (batch, [short[0][:4], short[1][:6], short[2], prompts(1, 32, 32, seed=17)[0]]):
            one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (chunked_tp1, chunked_tp2))
            assert_same_completions(one, two)
        mixed = [s for s in sent_steps if s.num_decodes and s.num_chunks]
        assert {s.unified for s in mixed} == {chunked_tp2.config.mixed_step_attention == "unified"}
        assert any(s.has_block_tables for s in mixed) and any(not s.has_block_tables for s in mixed)
        assert max(s.num_decodes for s in mixed) == 3
        assert any(s.num_logits_rows == 0 for s in sent_steps), "no step ended mid-prompt everywhere"

    def test_prefix_cache_hits_in_mixed_steps(self, chunked_tp2, chunked_tp1, sent_steps):
        """Decode rows beside chunks that continue a prefix-cache hit: both kinds of block table."""
        shared = prompts(1, 40, 40, seed=2)[0]  # 5 full blocks of 8
        short, *tails = prompts(3, 5, 30, seed=12)
        batch = [short[:5]] + [shared + tail for tail in tails]
        params = [greedy(16)] + [greedy(6)] * 2
        results = []
        for llm in (chunked_tp1, chunked_tp2):
            same_prefix_cache_state(llm)
            llm.generate([shared + [1]], greedy(1), use_tqdm=False)  # caches the shared blocks
            results.append(llm.generate(batch, params, use_tqdm=False))
        one, two = results
        assert [o.num_cached_tokens for o in two] == [o.num_cached_tokens for o in one] == [0, 40, 40]
        assert_same_completions(one, two)
        assert any(s.num_decodes and s.has_block_tables for s in sent_steps), "no decode rows beside a cached chunk"

    def test_prompt_logprobs_over_chunks_and_pieces(self, chunked_tp2, chunked_tp1, sent_steps, monkeypatch):
        """Prompt logprobs of prompts split over several steps, each step's span cut into pieces of
        PROMPT_LOGPROBS_CHUNK rows (changed here in rank 0's process only: the workers follow the
        pieces rank 0 sends), beside a request that decodes."""
        monkeypatch.setattr(logprobs, "PROMPT_LOGPROBS_CHUNK", 5)
        batch = prompts(3, 30, 70, seed=13)
        params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                  SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
                  SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)]
        one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (chunked_tp1, chunked_tp2))
        assert_same_completions(one, two)
        assert_same_prompt_logprobs([one[0], one[2]], [two[0], two[2]])
        assert one[1].prompt_logprobs is None and two[1].prompt_logprobs is None
        pieces = [piece for s in sent_steps for piece in s.prompt_logprob_pieces]
        assert max(rows for _, rows in pieces) == 5
        assert sum(rows for _, rows in pieces) == len(batch[0]) - 1 + len(batch[2]) - 1
        assert any(s.prompt_logprob_pieces and s.num_logits_rows == 0 for s in sent_steps)
        assert any(s.prompt_logprob_pieces and s.num_decodes for s in sent_steps)

    def test_n_seeded_samples_and_stop_strings(self, chunked_tp2, chunked_tp1):
        batch = prompts(2, 20, 40, seed=14)
        params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=1234, max_tokens=10, ignore_eos=True,
                                logprobs=1, prompt_logprobs=1)  # (the first of the n samples computes those)
        one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (chunked_tp1, chunked_tp2))
        assert_same_completions(one, two)
        assert_same_prompt_logprobs(one, two)
        assert len({tuple(c.token_ids) for c in one[0].outputs}) > 1, "the seeds made no difference"
        text = one[0].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        assert stop.strip(), f"no stop string to take from {text!r}"
        params = SamplingParams(n=3, temperature=1.0, top_k=50, seed=1234, max_tokens=10, ignore_eos=True, stop=stop)
        one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (chunked_tp1, chunked_tp2))
        assert one[0].outputs[0].finish_reason == "stop" and one[0].outputs[0].stop_reason == stop
        assert_same_completions(one, two)

    def test_preemption_mid_prefill(self, chunked_tp2, chunked_tp1, sent_steps):
        """14 blocks of 8: two 16-token prompts decode beside the chunks of a 72-token one (9 blocks),
        until the second decode needs a block: the part-prefilled prompt (the newest) is preempted
        and later recomputed from its first token, prompt logprobs included.

            step 1: | A[0:16] | B[0:8] |          step 2: | A | B[8:16] | C[0:15] |
            step 3: B needs a third block: C is preempted mid-prompt"""
        preempted_while_prefilling = []
        preempt = chunked_tp2.scheduler.preempt
        chunked_tp2.scheduler.preempt = lambda seq: preempted_while_prefilling.append(seq.is_prefilling) or preempt(seq)
        try:
            a, b, c = prompts(3, 72, 72, seed=4)
            batch = [a[:16], b[:16], c]
            params = [greedy(30), greedy(30), SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1)]
            one, two = (llm.generate(batch, params, use_tqdm=False) for llm in (chunked_tp1, chunked_tp2))
        finally:
            del chunked_tp2.scheduler.preempt
        assert any(preempted_while_prefilling), f"no preemption mid-prefill ({len(preempted_while_prefilling)} in all)"
        assert_same_completions(one, two)
        assert_same_prompt_logprobs(one[2:], two[2:])
        assert chunked_tp2.scheduler.kv_cache_manager.num_free_blocks == CHUNKED_ARGS["num_kvcache_blocks"]


def assert_same_completions(one, two):
    """Token for token, with the same finish reasons and logprobs within 1e-3."""
    assert len(one) == len(two)
    for a, b in zip(one, two):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason) == \
                (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason)
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for pa, pb in zip(ca.logprobs or [], cb.logprobs or []):
                assert pa.keys() == pb.keys()
                for token_id in pa:
                    assert pb[token_id].logprob == pytest.approx(pa[token_id].logprob, abs=1e-3)


def test_llama_fp8_weights_and_shutdown_stops_workers(llama_tiny_dir):
    """FP8 weights (quantization="fp8"): each rank quantizes its own shard, one scale per output
    channel, so a row-parallel layer's scales (over half the columns) are not one rank's and neither
    are the logits; but they are as close to full precision as one rank's FP8 logits are."""
    batch = prompts(4, 1, 50, seed=5)
    with LLM(llama_tiny_dir, **ENGINE_ARGS) as full, LLM(llama_tiny_dir, quantization="fp8", **ENGINE_ARGS) as fp8:
        reference, one_rank = teacher_forced_logits(full, batch, 6), teacher_forced_logits(fp8, batch, 6)
    llm = LLM(llama_tiny_dir, tensor_parallel_size=2, quantization="fp8", **ENGINE_ARGS)
    pids = llm.executor.worker_pids
    two_ranks = teacher_forced_logits(llm, batch, 6)
    assert two_ranks.keys() == reference.keys()
    for key, want in reference.items():
        one_error, two_error = ((got[key] - want).norm() / want.norm() for got in (one_rank, two_ranks))
        assert 1e-2 < two_error < 1.5 * one_error, f"(step, prompt) {key}: FP8 error {two_error:.3e} on two ranks, " \
                                                    f"{one_error:.3e} on one"
    llm.shutdown()
    assert wait_gone(pids) == []
    llm.shutdown()  # a second shutdown does nothing


def test_four_ranks_replicated_kv_heads_fp8_kv_cache_and_garbage_collection(llama_tiny_dir):
    """Four ranks, two KV heads: each rank holds one, a copy of its neighbour's. With an FP8 KV cache
    (per-tensor scales of 1.0, so each cached element rounds exactly as on one rank), chunked prefill
    and prompt logprobs, the same tokens as one rank. Dropping the engine stops the workers."""
    args = {**CHUNKED_ARGS, "kv_cache_dtype": "fp8"}
    batch = prompts(3, 20, 60, seed=15)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1, logprobs=1),
              greedy(8), greedy(8)]
    with LLM(llama_tiny_dir, **args) as one_rank:
        expected = one_rank.generate(batch, params, use_tqdm=False)
    llm = LLM(llama_tiny_dir, tensor_parallel_size=4, **args)
    assert llm.model_runner.attention_layers[0].num_kv_heads == 1
    assert llm.model_runner.kv_cache.dtype == torch.float8_e4m3fn
    results = llm.generate(batch, params, use_tqdm=False)
    assert_same_completions(expected, results)
    assert_same_prompt_logprobs(expected[:1], results[:1])
    pids = llm.executor.worker_pids
    assert len(pids) == 3
    del llm
    gc.collect()
    assert wait_gone(pids) == []


def test_killed_worker_is_a_clear_error_within_seconds(qwen3_tiny_dir):
    llm = LLM(qwen3_tiny_dir, device="cpu", tensor_parallel_size=2, max_model_len=512, max_num_batched_tokens=512,
              max_num_seqs=4)
    (pid,) = llm.executor.worker_pids
    killed_at = []

    def kill_soon():
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate([[1, 2, 3]] * 4, greedy(480), use_tqdm=False)  # ~ a minute of decoding if nothing failed
    assert time.monotonic() - killed_at[0] < 10
    with pytest.raises(WorkerDiedError):  # and it stays failed, clearly
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    llm.shutdown()
    assert wait_gone([pid]) == []
    assert spawned_children() == []


PARENT_SCRIPT = """
import sys
from minivllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2)
    print("workers", *llm.executor.worker_pids, flush=True)
    while True:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_worker_outlives_its_parent(qwen3_tiny_dir, tmp_path, how):
    """Ctrl-C in a terminal (SIGINT to the whole process group) or SIGKILL of the engine process
    alone: either way no worker is left behind."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    pids = []
    parent = subprocess.Popen([sys.executable, str(script), qwen3_tiny_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
                              preexec_fn=_default_sigint)
    try:
        line = _readline_within(parent, 180)
        assert line.startswith("workers"), f"parent printed {line!r}"
        pids += [int(pid) for pid in line.split()[1:]]
        time.sleep(1.0)  # mid-generation
        if how == "ctrl-c":
            os.killpg(parent.pid, signal.SIGINT)
        else:
            parent.kill()
        parent.wait(timeout=60)
        assert wait_gone(pids) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in wait_gone(pids, timeout=0):
            os.kill(pid, signal.SIGKILL)


def _default_sigint():
    """(In the child.) SIGINT's default action, as in a terminal: a test run started in the background of
    a shell (`cmd &`) hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _readline_within(process, timeout):
    line = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_graphs_and_eager_match_one_gpu(qwen3_tiny_dir):
    """NCCL, bfloat16, CUDA graphs with the all-reduces captured: TP=2 logits close to TP=1's, and
    TP=2 greedy tokens the same with graphs and eager."""
    args = dict(dtype="bfloat16", max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3)
    batch = prompts(8, 1, 300, seed=7)
    with LLM(qwen3_tiny_dir, **args) as one:
        reference = teacher_forced_logits(one, batch)
    outputs = {}
    for eager in (False, True):
        # prompt steps eager in both (their piecewise graphs pad to a bucket: close, not bit for bit)
        with LLM(qwen3_tiny_dir, tensor_parallel_size=2, enforce_eager=eager, max_prompt_graph_tokens=0, **args) as two:
            assert (getattr(two.model_runner, "graphs", None) is None) == eager
            if not eager:
                for key, logits in teacher_forced_logits(two, batch).items():
                    rel = (logits - reference[key]).norm() / reference[key].norm()
                    assert rel < 2e-2, f"(step, prompt) {key}: relative logits difference {rel:.3e}"
            outputs[eager] = tokens(two, batch, 32)
    assert outputs[False] == outputs[True]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_chunked_prefill_and_prompt_logprobs(qwen3_tiny_dir, monkeypatch):
    """NCCL: mixed steps, steps that sample nothing (an empty gather), prompt-logprob pieces, async
    scheduling, CUDA graphs for the decode-only steps and the pieces of prompt steps."""
    check_chunked_prefill_and_prompt_logprobs(qwen3_tiny_dir, monkeypatch, dtype="float32", max_model_len=512,
                                              max_num_seqs=16, gpu_memory_utilization=0.3)


def check_chunked_prefill_and_prompt_logprobs(model, monkeypatch, **args):
    """Two ranks against one, float32 (on the GPU Triton's dots may use TF32: loose tolerances)."""
    monkeypatch.setattr(logprobs, "PROMPT_LOGPROBS_CHUNK", 5)
    args.update(enable_chunked_prefill=True, max_num_batched_tokens=32)
    batch = prompts(6, 20, 120, seed=18)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    with LLM(model, **args) as one:
        reference = teacher_forced_logits(one, batch, 12)
        expected = one.generate(batch, params, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, async_scheduling=True, **args) as two:
        sent_steps = record_sent_steps(two)
        two_ranks = teacher_forced_logits(two, batch, 12)
        results = two.generate(batch, params, use_tqdm=False)
    assert two_ranks.keys() == reference.keys()
    for key, logits in two_ranks.items():
        rel = (logits - reference[key]).norm() / reference[key].norm()
        assert rel < 2e-2, f"(step, prompt) {key}: relative logits difference {rel:.3e}"
    for prompt, a, b in zip(batch, expected, results):
        want, got = ([p[token].logprob for token, p in zip(prompt[1:], out.prompt_logprobs[1:])] for out in (a, b))
        assert got == pytest.approx(want, abs=2e-2)
    mixed = [s for s in sent_steps if s.num_decodes and s.num_chunks]
    assert mixed and any(s.num_logits_rows == 0 for s in sent_steps)
    assert max(rows for s in sent_steps for _, rows in s.prompt_logprob_pieces) == 5


def test_every_step_reaches_the_other_ranks_even_when_a_graph_replays_it():
    """A CUDA-graph layer replays a step without calling on to the layers below it, so the layer that
    sends rank 0's inputs to the other ranks must sit above both graph layers, or the workers would
    wait for a step that never comes while rank 0's captured all-reduces wait for them."""
    from types import SimpleNamespace

    from minivllm.engine import cuda_graphs, prompt_graphs
    from minivllm.engine.assemble import model_runner_class
    from minivllm.engine.executor import TensorParallel

    config = SimpleNamespace(device="cuda", enforce_eager=False, attention_backend="triton",
                             max_prompt_graph_tokens=512, max_num_batched_tokens=8192,
                             kv_cache_torch_dtype=torch.float8_e4m3fn, torch_dtype=torch.bfloat16,
                             tensor_parallel_size=2, enable_chunked_prefill=True, mixed_step_attention="auto",
                             async_scheduling=True, spec_config=None, small_batch_gemv=True)
    mro = model_runner_class(config).__mro__
    graph_layers = (prompt_graphs.PromptCUDAGraphs, cuda_graphs.DecodeCUDAGraphs)
    assert all(layer in mro for layer in graph_layers)
    # the first class in the MRO that defines forward: nothing above it can skip the broadcast
    first_forward = next(cls for cls in mro if "forward" in vars(cls))
    assert first_forward is TensorParallel, [cls.__name__ for cls in mro]
