"""AsyncLLM without HTTP: requests from many coroutines share the batch, a request the engine rejects
fails alone, an abandoned stream frees its blocks, and DELTA outputs that queue up are merged; the
same with the engine loop in a process of its own, which also reports its death and start-up failures."""
import asyncio
import os
from dataclasses import replace
import shutil
import time

import pytest
import torch

from minivllm.engine.async_llm import AsyncLLM, CoreOptions, EngineDeadError, _merge_deltas
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

NUM_BLOCKS = 64
# An exception that kills the engine thread must fail the test, not pass as a warning.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
TIMEOUT = 60


@pytest.fixture(scope="module")
def async_llm(qwen3_tiny_dir):
    llm = AsyncLLM(qwen3_tiny_dir, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8,
                   num_kvcache_blocks=NUM_BLOCKS, kvcache_block_size=16)
    yield llm
    llm.shutdown()


def delta(max_tokens, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, **kwargs)


async def collect(llm, prompt, params, request_id=None):
    text, token_ids, outs = "", [], []
    async for out in llm.generate(prompt, params, request_id):
        text += out.outputs[0].text
        token_ids += out.outputs[0].token_ids
        outs.append(out)
    return text, token_ids, outs


def test_concurrent_requests_match_the_offline_engine(async_llm):
    prompts = [[5, 6, 7, i] for i in range(12)]  # more than max_num_seqs: some wait for a seat

    async def run():
        return await asyncio.wait_for(asyncio.gather(*[collect(async_llm, p, delta(6 + i % 3))
                                                       for i, p in enumerate(prompts)]), TIMEOUT)

    results = asyncio.run(run())
    engine = async_llm.engine
    for i, (text, token_ids, outs) in enumerate(results):
        assert len(token_ids) == 6 + i % 3 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].finish_reason == "length"
        assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS


def test_a_failing_request_fails_alone(async_llm, monkeypatch):
    """An error while the engine thread adds one request fails that request's stream; the loop and
    the other requests go on."""
    add_request = async_llm.engine.add_request

    def add_request_failing_for_bad(prompt, params, request_id=None):
        if request_id.startswith("bad@"):  # the engine knows it as "<caller id>@<n>"
            raise RuntimeError("injected failure")
        return add_request(prompt, params, request_id=request_id)

    monkeypatch.setattr(async_llm.engine, "add_request", add_request_failing_for_bad)

    async def run():
        good = asyncio.create_task(collect(async_llm, [1, 2, 3], delta(8)))
        with pytest.raises(RuntimeError, match="injected failure"):
            await asyncio.wait_for(collect(async_llm, [4, 5], delta(8), request_id="bad"), TIMEOUT)
        return await asyncio.wait_for(good, TIMEOUT)

    text, token_ids, _ = asyncio.run(run())
    assert len(token_ids) == 8 and async_llm.is_running


def test_bad_input_raises_before_queueing(async_llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            async_llm.generate([1] * 300, delta(4))
        with pytest.raises(ValueError, match="already in use"):
            async_llm.generate([1, 2], delta(50), request_id="same")
            async_llm.generate([1, 2], delta(50), request_id="same")
        async_llm.abort("same")

    asyncio.run(run())


def test_leaving_a_stream_aborts_it_and_frees_its_blocks(async_llm):
    async def run():
        async for _ in async_llm.generate([9, 8, 7], delta(200)):
            break  # the consumer goes away after the first output
        for _ in range(TIMEOUT * 20):  # the engine thread applies the abort before its next step
            if not async_llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert not async_llm.engine.has_unfinished_requests()
    assert async_llm.engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS


def test_merge_deltas():
    def out(text, ids, finish=None):
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, finish_reason=finish)],
                             finished=finish is not None)

    async def run():
        queue = asyncio.Queue()
        for piece in (out("b", [2]), out("c", [3], "length")):
            queue.put_nowait(piece)
        merged = _merge_deltas(out("a", [1]), queue)
        assert queue.empty()
        assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("abc", [1, 2, 3])
        assert merged.finished and merged.outputs[0].finish_reason == "length"
        queue.put_nowait(EngineDeadError("gone"))
        assert isinstance(_merge_deltas(out("a", [1]), queue), EngineDeadError)

    asyncio.run(run())


def test_shutdown_ends_streams_and_fails_new_requests(qwen3_tiny_dir):
    llm = AsyncLLM(qwen3_tiny_dir, max_model_len=64, num_kvcache_blocks=16)

    async def run():
        stream = llm.generate([1, 2], delta(60))
        await stream.__anext__()  # running
        llm.stop()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2], delta(2))

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    llm.shutdown()
    assert llm.engine.model_runner is None and not llm._thread.is_alive()


def test_an_id_can_be_reused_right_after_its_abort(async_llm):
    """Adds and aborts reach the engine in the order they were made."""
    async def run():
        first = async_llm.generate([1, 2, 3], delta(100), request_id="again")
        await first.__anext__()
        await first.aclose()  # aborts "again"
        return await asyncio.wait_for(collect(async_llm, [4, 5], delta(6), request_id="again"), TIMEOUT)

    text, token_ids, outs = asyncio.run(run())
    assert len(token_ids) == 6 and outs[-1].finished


# ---- the engine loop in a process of its own (what `minivllm serve` runs) ----------------------------
@pytest.fixture(scope="module")
def process_llm(qwen3_tiny_dir):
    llm = AsyncLLM(qwen3_tiny_dir, engine_process=True, core_options=CoreOptions(step_trace=True),
                   startup_timeout=120, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=8,
                   num_kvcache_blocks=NUM_BLOCKS, kvcache_block_size=16)
    yield llm
    llm.shutdown()


def test_engine_process_gives_the_thread_engines_tokens(process_llm, async_llm):
    """Same requests, same greedy tokens and text, whether the loop runs in a thread or a process;
    prompts come back with the outputs although the process does not send them."""
    prompts = [[5, 6, 7, i] for i in range(12)]

    async def run(llm):
        return await asyncio.wait_for(asyncio.gather(*[collect(llm, p, delta(6 + i % 3))
                                                       for i, p in enumerate(prompts)]), TIMEOUT)

    in_process, in_thread = asyncio.run(run(process_llm)), asyncio.run(run(async_llm))
    assert process_llm.engine is None
    for (text, token_ids, outs), (text_t, token_ids_t, _), prompt in zip(in_process, in_thread, prompts):
        assert token_ids == token_ids_t and text == text_t and outs[-1].finished
        assert outs[-1].prompt_token_ids == prompt


def test_engine_process_checks_requests_before_sending_them(process_llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            process_llm.generate([1] * 300, delta(4))
        with pytest.raises(TypeError, match="a prompt must be"):
            process_llm.generate([1.5], delta(4))

    asyncio.run(run())


def test_engine_process_abort_frees_blocks_and_trace_counts_every_token(process_llm):
    async def run():
        await process_llm.take_step_trace()  # drop the earlier tests' steps
        async for _ in process_llm.generate([9, 8, 7], delta(200)):
            break  # the consumer goes away after the first output: aborted
        for _ in range(TIMEOUT * 20):
            stats = process_llm.scheduler_stats
            if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        await process_llm.take_step_trace()
        await collect(process_llm, [3, 1, 4, 1, 5], delta(7))  # 5 prompt tokens, then 6 decodes
        return process_llm.scheduler_stats, await process_llm.take_step_trace()

    stats, steps = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert sum(s["num_tokens"] for s in steps) == 5 + 7 - 1
    assert steps[0]["kind"] == "prefill" and {s["kind"] for s in steps[1:]} == {"decode"}
    assert all(0 <= s["wall_ms"] <= s["host_ms"] for s in steps)
    on_cuda = torch.cuda.is_available()  # device time between CUDA events; none on the CPU
    device_ms = [s["device_ms"] for s in steps if s["device_ms"] is not None]
    assert all(ms > 0 for ms in device_ms) and (len(device_ms) > 0) == on_cuda


def test_engine_process_that_dies_ends_every_stream(qwen3_tiny_dir):
    llm = AsyncLLM(qwen3_tiny_dir, engine_process=True, startup_timeout=120, max_model_len=64, num_kvcache_blocks=16)

    async def run():
        stream = llm.generate([1, 2], delta(60))
        await stream.__anext__()  # running
        llm._core.process.kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2], delta(2))

    try:
        asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    finally:
        llm.shutdown()
    assert llm._core.process.exitcode is not None


def test_engine_process_that_fails_to_start_says_why(qwen3_tiny_dir, tmp_path):
    for name in os.listdir(qwen3_tiny_dir):  # everything but the weights
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(qwen3_tiny_dir, name), tmp_path)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no \\*.safetensors files"):
        AsyncLLM(str(tmp_path), engine_process=True, startup_timeout=120, max_model_len=64)
    assert time.monotonic() - start < 120
    start = time.monotonic()
    with pytest.raises(TypeError, match="unknown engine arguments \\['max_num_sequences'\\]"):
        AsyncLLM(qwen3_tiny_dir, engine_process=True, max_num_sequences=8)  # checked here, the process stopped
    assert time.monotonic() - start < 60


def test_warm_up_leaves_the_engine_as_it_found_it(qwen3_tiny_dir):
    from minivllm.engine.engine_core import warm_up
    from minivllm.engine.llm_engine import LLMEngine

    with LLMEngine(qwen3_tiny_dir, max_model_len=128, num_kvcache_blocks=NUM_BLOCKS, max_num_seqs=4) as engine:
        warm_up(engine)
        blocks = engine.scheduler.kv_cache_manager
        assert not engine.has_unfinished_requests() and blocks.num_free_blocks == NUM_BLOCKS
        assert not blocks.pool.hash_to_block_id  # the prefix cache is empty
        assert engine.stats.num_decode_tokens > 0  # it did run


def test_step_trace_summary_names_the_stall():
    from minivllm.engine.step_trace import summarize

    def step(kind, start_s, wall_ms, gap_ms):
        return dict(kind=kind, num_seqs=4, num_tokens=4 if kind == "decode" else 400, num_cached_tokens=0,
                    start_s=start_s, host_ms=wall_ms, wall_ms=wall_ms, device_ms=wall_ms - 0.5, device_gap_ms=gap_ms)

    # Ten 2 ms decodes back to back, then 80 ms with no step, then a 30 ms prefill that the device ran for 29.5 ms.
    records = [step("decode", 0.002 * i, 2.0, 0.5) for i in range(10)] + [step("prefill", 0.1, 30.0, 80.5)]
    text = summarize(records, num_slowest=1)
    assert "11 steps over 0.13 s; in steps 0.05 s, outside steps (engine idle or loop overhead) 0.08 s" in text
    assert "decode       10 steps,    0.02 s; wall ms p50   2.00" in text
    slowest, longest_gap = [line for line in text.splitlines() if line.startswith("    #")]
    assert slowest.startswith("    #10 t=0.100s prefill 4 seqs 400 tokens: wall 30.00 ms") and slowest == longest_gap
    assert "device idle before it 80.50 ms (after a decode of 4 seqs)" in slowest
    assert summarize([]) == "step trace: no steps"


def test_engine_process_text_with_stop_strings_and_n(process_llm, async_llm):
    """Streams without stop strings are decoded on the server's side, those with stop strings by the
    engine: both give the in-thread engine's text, cut and reasons, also with n=2."""
    async def run(llm, params):
        outs = [out async for out in llm.generate("Once upon a time", params)]
        by_index = {}
        for out in outs:
            for c in out.outputs:
                text, ids, _ = by_index.get(c.index, ("", [], None))
                by_index[c.index] = (text + c.text, ids + c.token_ids, (c.finish_reason, c.stop_reason))
        return by_index

    full = asyncio.run(run(async_llm, delta(20)))[0][0]
    stop = full[6:9]  # a piece the greedy text contains, so it must stop there
    sampled = replace(delta(12, n=2, seed=3), temperature=0.9)
    cumulative = replace(delta(40, n=2, seed=5), temperature=1.0, output_kind=RequestOutputKind.CUMULATIVE)
    final_only = replace(cumulative, output_kind=RequestOutputKind.FINAL_ONLY)
    cases = [delta(20), delta(20, stop=[stop]), sampled, delta(20, stop=[stop], n=2), cumulative, final_only]
    sent = []  # what the engine process is asked for
    add = process_llm._core.add
    process_llm._core.add = lambda key, token_ids, params: sent.append(params) or add(key, token_ids, params)
    try:
        for params in cases:
            in_process, in_thread = asyncio.run(run(process_llm, params)), asyncio.run(run(async_llm, params))
            assert in_process == in_thread
    finally:
        process_llm._core.add = add
    assert [p.detokenize for p in sent] == [bool(p.stop) for p in cases]  # decoded here unless stop strings
    stopped = asyncio.run(run(process_llm, cases[1]))[0]
    assert stopped[0] == full[:full.index(stop)] and stopped[2] == ("stop", stop)


def test_detokenize_false_gives_tokens_without_text(async_llm):
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])

    async def run(params):
        return await asyncio.wait_for(collect(async_llm, [5, 6, 7], params), TIMEOUT)

    text, token_ids, _ = asyncio.run(run(delta(6, detokenize=False)))
    assert text == "" and token_ids == asyncio.run(run(delta(6)))[1]


def test_step_trace_matches_each_collected_step_to_its_launch():
    """Steps are matched to their launch by their handle (also once narrowed to the live rows); a
    launch never collected (async scheduling's step ahead for sequences that all finished) still
    counts as device time before the next gap."""
    from types import SimpleNamespace

    from minivllm.core.engine import StepResult
    from minivllm.core.scheduler import SchedulerOutput
    from minivllm.engine.step_trace import StepTrace

    class Event:  # a CUDA event's timing API, at a given device time (ms)
        def __init__(self, ms):
            self.ms = ms

        def synchronize(self):
            pass

        def elapsed_time(self, later):
            return later.ms - self.ms

    trace = StepTrace(use_cuda_events=True)
    handles = [SimpleNamespace(launched_as=None) for _ in range(3)]
    out = SchedulerOutput.decodes([])
    trace.launched(handles[0], Event(0.0), Event(2.0))
    trace.launched(handles[1], Event(2.5), Event(4.0))  # never collected
    trace.collected_events(handles[0])
    trace.collected(StepResult(out, None, 0.0), 0.003)
    trace.launched(handles[2], Event(5.0), Event(6.0))
    narrowed = SimpleNamespace(launched_as=handles[2])  # StepHandle.select names the launched handle
    trace.collected_events(narrowed)
    trace.collected(StepResult(out, None, 0.002), 0.007)  # scheduled while the first step still ran
    first, second = trace.take()
    assert (first["device_ms"], first["device_gap_ms"]) == (2.0, None)
    assert (second["device_ms"], second["device_gap_ms"]) == (1.0, 1.0)  # from the end of the dropped step
    assert second["wall_ms"] == pytest.approx(4.0) and second["host_ms"] == pytest.approx(5.0)
    assert trace.take() == []
