"""vLLM's API on a CUDA GPU: logprobs and penalties on the kernel path (CUDA graphs, async
scheduling, the Triton sampling kernel) against the eager synchronous path and transformers.
Skipped without CUDA."""
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# An explicit KV size: no memory profiling, so engines built earlier in the process do not matter.
ENGINE_ARGS = dict(max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=8, num_kvcache_blocks=256)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 2, 2, 41, 7, 900, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [42]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, repetition_penalty=1.4, logprobs=3,
                         prompt_logprobs=2),
          SamplingParams(temperature=0.9, max_tokens=16, seed=4, presence_penalty=1.0, frequency_penalty=0.5,
                         logprobs=0),
          SamplingParams(temperature=0.7, max_tokens=12, seed=9, n=2, logprobs=5, ignore_eos=True)]


def run_one_at_a_time(engine, prompts, params):
    """Each request alone, so that both engines see the same batches (bf16 results depend on them)."""
    return [engine.generate([prompt], sp, use_tqdm=False)[0] for prompt, sp in zip(prompts, params)]


def release(engine):
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_kernel_path_equals_eager_sync_path_with_logprobs_and_penalties(qwen3_tiny_dir):
    results = {}
    # (prompt steps eager in both: their piecewise graphs pad to a bucket, close to eager but not bit for bit)
    for name, args in [("graphs+async", dict(max_prompt_graph_tokens=0)),
                       ("eager+sync", dict(enforce_eager=True, async_scheduling=False))]:
        engine = LLM(qwen3_tiny_dir, dtype="bfloat16", **ENGINE_ARGS, **args)
        assert engine.config.async_scheduling == (name == "graphs+async")
        results[name] = run_one_at_a_time(engine, PROMPTS, PARAMS)
        assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.config.num_kvcache_blocks
        release(engine)
    for fast, slow in zip(results["graphs+async"], results["eager+sync"]):
        assert [c.token_ids for c in fast.outputs] == [c.token_ids for c in slow.outputs]
        for got, want in zip(fast.outputs, slow.outputs):
            assert [list(p) for p in got.logprobs] == [list(p) for p in want.logprobs]
            assert [lp.logprob for p in got.logprobs for lp in p.values()] == pytest.approx(
                [lp.logprob for p in want.logprobs for lp in p.values()], abs=1e-5)
        if slow.prompt_logprobs is not None:
            assert [p and list(p) for p in fast.prompt_logprobs] == [p and list(p) for p in slow.prompt_logprobs]
    assert len(results["graphs+async"][2].outputs) == 2


def test_asking_for_logprobs_does_not_change_the_samples(qwen3_tiny_dir):
    engine = LLM(qwen3_tiny_dir, dtype="bfloat16", **ENGINE_ARGS)
    params = [SamplingParams(temperature=t, max_tokens=16, seed=s, ignore_eos=True) for t, s in [(0.0, None), (0.8, 1)]]
    with_logprobs = [SamplingParams(temperature=p.temperature, max_tokens=16, seed=p.seed, ignore_eos=True, logprobs=2)
                     for p in params]
    plain = engine.generate(PROMPTS[:2], params, use_tqdm=False)
    extra = engine.generate(PROMPTS[:2], with_logprobs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in extra]
    assert all(len(o.outputs[0].logprobs) == 16 for o in extra)
    release(engine)


def test_gpu_logprobs_equal_transformers(qwen3_tiny_dir):
    """float32 on the GPU (Triton's fp32 dots may use TF32: a loose tolerance) against transformers
    on the CPU, teacher-forced on the engine's own tokens."""
    engine = LLM(qwen3_tiny_dir, dtype="float32", **ENGINE_ARGS)
    outputs = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.8, seed=0, max_tokens=10, logprobs=2,
                                                          prompt_logprobs=1, repetition_penalty=1.2), use_tqdm=False)
    release(engine)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_tiny_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            reference = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(dim=-1)
        got = [p[t].logprob for t, p in zip(tokens, out.outputs[0].logprobs)]
        expected = [reference[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]
        assert got == pytest.approx(expected, abs=2e-2)
        got = [p[prompt[i]].logprob for i, p in enumerate(out.prompt_logprobs[1:], start=1)]
        expected = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert got == pytest.approx(expected, abs=2e-2)
