"""The engine for a server: an engine loop steps while asyncio callers stream.

    caller (event loop)                    engine loop (a thread here, or a process of its own)
    generate(prompt) --add--> inbox ---->  add_request / abort_request between steps
         ^                                 step() -> RequestOutputs of every streaming request
         |                                     |
    asyncio.Queue per request <--- one call_soon_threadsafe per step (all outputs of the step)

Requests join the running batch at the next step, whoever sent them (continuous batching across
clients). By default the loop is a thread of this process, so the whole engine stays one readable
object (`async_llm.engine`); with engine_process=True it runs in a spawned process
(engine_core.EngineCoreClient), as vLLM's does, so that it never waits for the GIL behind the
HTTP server. vLLM: vllm/v1/engine/async_llm.py (AsyncLLM).
"""
import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.engine_core import (CoreOptions, EngineCore, EngineCoreClient, EngineDeadError,  # noqa: F401
                                         SchedulerStats, prepare_engine)
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("minivllm")


class RequestAbortedError(RuntimeError):
    """Raised in a request's stream when someone else called `abort` on it."""


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds from arrival to the last token
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step produced, for the metrics (vLLM: vllm/v1/metrics/stats.py)."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per new request
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per streaming request
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _RequestState:
    request_id: str  # the caller's; the engine knows the request by a key unique for the engine's life
    queue: asyncio.Queue  # RequestOutput, or an Exception that ends the stream
    num_prompt_tokens: int
    output_kind: RequestOutputKind
    arrival_time: float
    prompt: str | None
    prompt_token_ids: list[int]
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    # Sample index -> its detokenizer, for a request whose text this process decodes (see _add)
    detokenizers: dict[int, IncrementalDetokenizer] | None = None


def _merge_deltas(out: RequestOutput | BaseException, queue: asyncio.Queue) -> RequestOutput | BaseException:
    """Fold the DELTA outputs waiting in a request's queue into one: a consumer slower than the
    engine (a busy event loop) then sends fewer, larger chunks instead of falling further behind.
    An exception in the queue wins (the stream ends with it)."""
    pieces = [out]
    while not queue.empty():
        pieces.append(queue.get_nowait())
    errors = [p for p in pieces if isinstance(p, BaseException)]
    if errors:
        return errors[0]
    by_index = {}  # CompletionOutput.index -> the merged completion (n > 1: one per sequence)
    for piece in pieces:
        for c in piece.outputs:
            merged = by_index.setdefault(c.index, c)
            if merged is not c:
                merged.text += c.text
                merged.token_ids = merged.token_ids + c.token_ids
                if c.logprobs:
                    merged.logprobs = (merged.logprobs or []) + c.logprobs
                merged.finish_reason, merged.stop_reason = c.finish_reason, c.stop_reason
                merged.cumulative_logprob = c.cumulative_logprob
    last = pieces[-1]
    last.outputs = [by_index[i] for i in sorted(by_index)]
    return last


class AsyncLLM:
    """An LLMEngine stepped by a background loop, with an async `generate` per request.

    Args:
        model: a local Hugging Face model directory.
        stat_loggers: objects with `record(iteration_stats)`, called from a background thread after
            every step that produced outputs (the server's Prometheus metrics).
        engine_process: run the engine loop in a spawned process of its own (the server's choice);
            False: in a thread of this process, the engine then being `self.engine`.
        core_options: warm-up and step trace before the loop starts (default: neither in a thread;
            with engine_process, a warm-up on CUDA).
        startup_timeout: with engine_process, seconds to wait for the engine to be ready.
        **engine_kwargs: engine options, see `minivllm.config.Config`.
    """

    def __init__(self, model: str, stat_loggers: list | None = None, engine_process: bool = False,
                 core_options: CoreOptions | None = None, startup_timeout: float = 600.0, **engine_kwargs):
        self.stat_loggers = list(stat_loggers or [])
        self._loop: asyncio.AbstractEventLoop | None = None  # the callers' loop, bound at the first request
        # Engine key -> state. The engine knows each request by a key never used twice
        # ("<caller's id>@<n>"), so outputs still on their way for an aborted request can never
        # reach a later request that reuses its id.
        self._states: dict[str, _RequestState] = {}  # touched only on the callers' loop
        self._keys: dict[str, str] = {}  # caller's request id -> engine key, while it runs
        self._next_key = 0
        self._next_id = 0
        self._stopping = False
        self.scheduler_stats = SchedulerStats()  # as of the last step (the metrics' gauges)
        if engine_process:
            # Start the process first: torch imports and the tokenizer loads here while the engine
            # builds there.
            self.engine = None
            self._core = EngineCoreClient(model, engine_kwargs, self._post, self._engine_died, core_options)
            try:
                from minivllm.engine.llm_engine import load_tokenizer, make_config

                self.config = make_config(model, **engine_kwargs)
                self.tokenizer = load_tokenizer(self.config)
                self._core.wait_ready(startup_timeout)
            except BaseException:
                self._core.shutdown(timeout=10)
                raise
            self._thread = None
        else:
            from minivllm.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(model, **engine_kwargs)
            if core_options is not None:
                prepare_engine(self.engine, core_options)
            self.config, self.tokenizer = self.engine.config, self.engine.tokenizer
            self._core = EngineCore(self.engine, self._post)
            self._thread = threading.Thread(target=self._core.run, name="minivllm-engine", daemon=True)
            self._thread.start()
        from minivllm.engine.processor import InputProcessor

        self.input_processor = InputProcessor(self.config, self.tokenizer)

    @property
    def is_running(self) -> bool:
        alive = self._core.is_alive if self._thread is None else self._thread.is_alive()
        return alive and not self._stopping

    # ---- callers' side (the event loop) ----------------------------------------------------------------
    def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; return the async iterator of its outputs (the last has finished=True).

        Call it from the event loop. Bad input raises here (TypeError/ValueError), before anything
        is queued. Leaving the iteration early (a client that disconnected: the task is cancelled,
        or the iterator closed) aborts the request and frees its KV blocks.
        """
        state, key = self._add(prompt, sampling_params, request_id)
        return self._stream(state, key)

    async def _stream(self, state: "_RequestState", key: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await state.queue.get()
                if not state.queue.empty() and state.output_kind is RequestOutputKind.DELTA:
                    out = _merge_deltas(out, state.queue)
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                if state.detokenizers is not None:
                    self._decode_text(state, out)
                out.request_id = state.request_id
                if out.prompt_token_ids is None:  # from the engine process, which leaves the prompt out
                    out.prompt, out.prompt_token_ids = state.prompt, state.prompt_token_ids
                yield out
        finally:
            if finished:
                self._forget(key)
            else:
                self._abort_key(key)

    def _decode_text(self, state: _RequestState, out: RequestOutput):
        """Fill in the text of the completions of a request whose engine sends token ids only."""
        for completion in out.outputs:
            detokenizer = state.detokenizers.get(completion.index)
            if detokenizer is None:
                detokenizer = state.detokenizers[completion.index] = IncrementalDetokenizer(
                    self.tokenizer, state.prompt_token_ids)
            if state.output_kind is RequestOutputKind.DELTA:  # token_ids: the new ones
                completion.text = detokenizer.add_tokens(completion.token_ids)
            else:  # all of them so far
                detokenizer.add_tokens(completion.token_ids[len(detokenizer.token_ids):])
                completion.text = detokenizer.text

    def _forget(self, key: str) -> _RequestState | None:
        state = self._states.pop(key, None)
        if state is not None and self._keys.get(state.request_id) == key:
            del self._keys[state.request_id]
        return state

    def _add(self, prompt, sampling_params: SamplingParams, request_id: str | None):
        if not self.is_running:
            raise EngineDeadError("the engine has shut down")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._states:
                raise RuntimeError("an AsyncLLM serves one event loop at a time; this one has requests in flight")
            self._loop = loop
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self._keys:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if self.engine is not None:
            text, token_ids = self.engine.check_request(prompt, sampling_params)  # (read-only: safe from this thread)
        else:
            text, token_ids = self.input_processor.check_request(prompt, sampling_params)
        state = _RequestState(request_id, asyncio.Queue(), len(token_ids), sampling_params.output_kind,
                              time.perf_counter(), text, token_ids)
        if self.engine is None and self.tokenizer is not None and sampling_params.detokenize and not sampling_params.stop:
            # The engine process sends token ids only and the text is decoded here, as vLLM's front end
            # does: decoding every stream at every step would sit on the engine loop's critical path.
            # (Stop strings are looked for in the text, so their requests are decoded by the engine.)
            sampling_params = replace(sampling_params, detokenize=False)
            state.detokenizers = {}
        key, self._next_key = f"{request_id}@{self._next_key}", self._next_key + 1
        self._states[key] = state
        self._keys[request_id] = key
        self._core.add(key, token_ids, sampling_params)
        return state, key

    def abort(self, request_id: str) -> None:
        """Abort a request: the engine loop frees its blocks before its next step."""
        key = self._keys.get(request_id)
        if key is not None:
            self._abort_key(key)

    def _abort_key(self, key: str) -> None:
        state = self._forget(key)
        if state is None:
            return  # finished, or aborted already
        request_id = state.request_id
        state.queue.put_nowait(RequestAbortedError(f"request {request_id!r} was aborted"))
        stats = IterationStats(finished_requests=[FinishedRequestStats(
            "abort", time.perf_counter() - state.arrival_time, state.num_prompt_tokens, state.num_generation_tokens)])
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        self._core.abort(key)

    def _deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException]):
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is not None:  # None: aborted meanwhile
                state.queue.put_nowait(out)
        for request_id, error in errors.items():
            state = self._states.get(request_id)
            if state is not None:
                state.queue.put_nowait(error)

    async def take_step_trace(self) -> list[dict] | None:
        """The engine's step records since the last call (see step_trace.py); None when the trace
        is off (the engine process's CoreOptions.step_trace, or engine.start_step_trace())."""
        if self.engine is None:
            return await asyncio.wrap_future(self._core.take_step_trace())
        future = concurrent.futures.Future()
        self._core.call(lambda: future.set_result(
            self.engine.step_trace.take() if self.engine.step_trace is not None else None))
        return await asyncio.wrap_future(future)

    # ---- engine loop's side (a background thread) --------------------------------------------------------
    def _post(self, outputs: list[RequestOutput], errors: dict[str, BaseException], stats: SchedulerStats | None):
        if stats is not None:
            self.scheduler_stats = stats
        if not outputs and not errors:
            return
        if self.stat_loggers and outputs:
            self._record(outputs)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._deliver, outputs, errors)
            except RuntimeError:  # the loop closed in between
                pass

    def _engine_died(self, error: EngineDeadError):
        """The engine process has gone: every stream still open ends with `error`."""
        self._stopping = True
        self._post([], dict.fromkeys(list(self._states), error), None)

    def _record(self, outputs: list[RequestOutput]):
        """Time to first token, inter-token latency and request totals, measured when the step's
        outputs leave the engine loop (vLLM's frontend measures them the same way)."""
        now, stats = time.perf_counter(), IterationStats()
        states = self._states  # read from this thread: entries only come and go, a miss is skipped
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue
            num_new = self._num_new_tokens(out, state)
            if num_new:
                if state.last_token_time is None:
                    stats.time_to_first_tokens.append(now - state.arrival_time)
                    stats.num_prompt_tokens += state.num_prompt_tokens
                else:
                    stats.inter_token_latencies.append(now - state.last_token_time)
                state.last_token_time = now
                state.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if out.finished:
                reason = out.outputs[-1].finish_reason if out.outputs else None
                stats.finished_requests.append(FinishedRequestStats(
                    reason or "abort", now - state.arrival_time,
                    state.num_prompt_tokens, state.num_generation_tokens))
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)

    @staticmethod
    def _num_new_tokens(out: RequestOutput, state: _RequestState) -> int:
        num = sum(len(c.token_ids) for c in out.outputs)
        return num if state.output_kind is RequestOutputKind.DELTA else num - state.num_generation_tokens

    # ---- lifetime ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to stop (returns at once): the requests still running are aborted and their
        streams end with EngineDeadError; new requests are refused."""
        self._stopping = True
        self._core.stop()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop, wait for it, and shut the engine down (its device memory is released)."""
        if self._thread is None:
            self._stopping = True
            self._core.shutdown(timeout)
            return
        if self.engine.model_runner is None:
            return  # shut down already
        self.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)
            return
        self.engine.shutdown()
