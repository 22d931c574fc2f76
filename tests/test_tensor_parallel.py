"""Tensor parallelism on the CPU (gloo, two ranks): the same logits and tokens as one rank, prefix
caching and preemption across ranks, the shards each rank loads, and the worker processes' life
cycle (shutdown, garbage collection, a killed worker, a killed or interrupted parent)."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from benchmarks.common import teacher_forced_logits
from minivllm import LLM, SamplingParams
from minivllm.engine.executor import WorkerDiedError
from minivllm.utils.loader import build_model

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
            shard = dict(build_model(llama_tiny_dir, tp_rank=rank, tp_size=tp_size).named_parameters())
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
        assert qwen3_tp2.scheduler.block_manager.num_free_blocks == ENGINE_ARGS["num_kvcache_blocks"]


def assert_same_prompt_logprobs(one, two):
    for a, b in zip(one, two):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for token_id in pa:
                assert pb[token_id].logprob == pytest.approx(pa[token_id].logprob, abs=1e-3)


def test_chunked_prefill_and_prompt_logprobs_match_one_rank(qwen3_tiny_dir):
    """A 24-token budget splits the prompts across steps and mixes decode rows with prompt chunks:
    the workers get the mixed step's decode metadata and compute the LM-head shard of exactly the
    rows rank 0 samples (none for a chunk that ends mid-prompt) and the prompt-logprob rows."""
    args = {**ENGINE_ARGS, "max_num_batched_tokens": 24, "enable_chunked_prefill": True}
    batch = prompts(5, 20, 70, seed=11)
    with LLM(qwen3_tiny_dir, **args) as one_rank:
        expected = tokens(one_rank, batch, 12)
        with_prompt_logprobs = one_rank.generate(batch[:2], SamplingParams(max_tokens=3, prompt_logprobs=1),
                                                 use_tqdm=False)
    with LLM(qwen3_tiny_dir, tensor_parallel_size=2, **args) as two_ranks:
        assert two_ranks.config.enable_chunked_prefill
        steps = []
        schedule = two_ranks.scheduler.schedule
        two_ranks.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        assert tokens(two_ranks, batch, 12) == expected
        assert_same_prompt_logprobs(with_prompt_logprobs, two_ranks.generate(
            batch[:2], SamplingParams(max_tokens=3, prompt_logprobs=1), use_tqdm=False))
    assert any(out.is_prefill and out.num_decodes > 0 for out in steps), "no mixed step was scheduled"
    assert any(out.is_prefill and not out.sampled_seqs for out in steps), "no step ended mid-prompt everywhere"


def test_llama_matches_one_rank_and_shutdown_stops_workers(llama_tiny_dir):
    batch = prompts(4, 1, 50, seed=5)
    expected = tokens(LLM(llama_tiny_dir, **ENGINE_ARGS), batch, 10)
    llm = LLM(llama_tiny_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    pids = llm.executor.worker_pids
    assert tokens(llm, batch, 10) == expected
    llm.shutdown()
    assert wait_gone(pids) == []
    llm.shutdown()  # a second shutdown does nothing


def test_replicated_kv_heads_and_garbage_collection_stops_workers(tmp_path):
    """One KV head on two ranks: both hold a copy of it. Dropping the engine stops the workers."""
    from minivllm.tools.make_model import make_model

    model = str(make_model({"preset": "llama-tiny", "num_key_value_heads": 1, "num_hidden_layers": 2}, tmp_path / "m"))
    batch = prompts(3, 5, 40, seed=6)
    expected = tokens(LLM(model, **ENGINE_ARGS), batch, 8)
    llm = LLM(model, tensor_parallel_size=2, **ENGINE_ARGS)
    assert llm.model_runner.attention_layers[0].num_kv_heads == 1
    assert tokens(llm, batch, 8) == expected
    pids = llm.executor.worker_pids
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
                              stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
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
        with LLM(qwen3_tiny_dir, tensor_parallel_size=2, enforce_eager=eager, **args) as two:
            assert (two.model_runner.graphs is None) == eager
            if not eager:
                for key, logits in teacher_forced_logits(two, batch).items():
                    rel = (logits - reference[key]).norm() / reference[key].norm()
                    assert rel < 2e-2, f"(step, prompt) {key}: relative logits difference {rel:.3e}"
            outputs[eager] = tokens(two, batch, 32)
    assert outputs[False] == outputs[True]
