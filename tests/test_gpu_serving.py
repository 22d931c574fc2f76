"""Serving on a CUDA GPU: AsyncLLM with CUDA graphs and async scheduling (a decode step launched
before the last one's tokens are known) streams every token once, aborts free their blocks, the
engine in a process of its own warms up and times its steps on the device, and the serving
benchmark runs against a launched server. Skipped without CUDA (the benchmark part also
without fastapi/uvicorn/aiohttp)."""
import asyncio
import importlib.util
import json

import pytest
import torch

from minivllm.engine.async_llm import AsyncLLM, CoreOptions
from minivllm.sampling_params import RequestOutputKind, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_BLOCKS = 256
ENGINE_ARGS = dict(dtype="bfloat16", max_model_len=256, max_num_batched_tokens=1024, max_num_seqs=16,
                   num_kvcache_blocks=NUM_BLOCKS)
TIMEOUT = 120


def test_async_llm_streams_on_the_kernel_path(qwen3_tiny_dir):
    llm = AsyncLLM(qwen3_tiny_dir, **ENGINE_ARGS)
    assert llm.engine.config.async_scheduling
    tokenizer = llm.tokenizer

    async def stream(i, max_tokens, abandon_after=None):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        text, token_ids = "", []
        async for out in llm.generate([5 + i, 6, 7, 8 + i], params):
            text += out.outputs[0].text
            token_ids += out.outputs[0].token_ids
            if abandon_after is not None and len(token_ids) >= abandon_after:
                break
        return text, token_ids

    async def run():
        jobs = [stream(i, 10 + 7 * i) for i in range(24)] + [stream(100 + i, 200, abandon_after=5) for i in range(4)]
        return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)

    try:
        results = asyncio.run(run())
        for i, (text, token_ids) in enumerate(results[:24]):
            assert len(token_ids) == 10 + 7 * i and -1 not in token_ids  # no placeholder ever leaks out
            # An incomplete UTF-8 character at the very end is never emitted (it has no text yet).
            assert text == tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
        for text, token_ids in results[24:]:
            assert 5 <= len(token_ids) < 200

        async def settle():
            for _ in range(TIMEOUT * 20):
                if not llm.engine.has_unfinished_requests():
                    return
                await asyncio.sleep(0.05)

        asyncio.run(settle())
        blocks = llm.engine.scheduler.kv_cache_manager
        assert not llm.engine.has_unfinished_requests() and blocks.num_free_blocks == NUM_BLOCKS
    finally:
        llm.shutdown()


def test_engine_process_warms_up_and_traces_device_time(qwen3_tiny_dir):
    """The server's layout on CUDA: the engine in a spawned process, warmed up, with a step trace
    whose device times come from CUDA events; greedy tokens as the in-thread engine gives them."""
    options = CoreOptions(warm_up=True, step_trace=True)
    in_process = AsyncLLM(qwen3_tiny_dir, engine_process=True, core_options=options, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run(llm):
        async def one(i):
            return [t async for out in llm.generate([5 + i, 6, 7, 8 + i], params) for t in out.outputs[0].token_ids]
        return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(8)]), TIMEOUT)

    async def trace(llm):
        return await llm.take_step_trace()

    try:
        asyncio.run(trace(in_process))  # drop the warm-up's steps
        tokens = asyncio.run(run(in_process))
        steps = asyncio.run(trace(in_process))
    finally:
        in_process.shutdown()
    in_thread = AsyncLLM(qwen3_tiny_dir, **ENGINE_ARGS)
    try:
        assert tokens == asyncio.run(run(in_thread))
    finally:
        in_thread.shutdown()
    assert sum(s["num_tokens"] + s["num_cached_tokens"] for s in steps) == 8 * (4 + 12 - 1)
    assert all(s["device_ms"] > 0 for s in steps) and all(s["device_gap_ms"] >= 0 for s in steps[1:])
    print(min(s["device_ms"] for s in steps), max(s["device_gap_ms"] for s in steps[1:]))


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "aiohttp")),
                    reason="needs fastapi, uvicorn and aiohttp (benchmarks/serving_wheels.sh)")
def test_bench_serving_against_a_launched_server(qwen3_tiny_dir, tmp_path):
    from benchmarks import bench_serving

    code = bench_serving.main(["--launch", qwen3_tiny_dir, "--server-args", "--max-model-len 512 --max-num-seqs 64",
                               "--num-prompts", "64", "--input-len", "128", "--output-len", "32",
                               "--request-rate", "50", "inf", "--out-dir", str(tmp_path)])
    assert code == 0
    payload = json.loads((tmp_path / "bench_serving.json").read_text())
    for r in payload["results"]:
        assert r["completed"] == 64 and r["total_output_tokens"] == 64 * 32
        assert "device busy" in r["step_trace"]  # the launched server's steps, timed on the device
    print(json.dumps(payload["results"], indent=1))
