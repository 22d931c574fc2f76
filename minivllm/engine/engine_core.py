"""The serving engine loop, in a thread of the caller's process or in a process of its own.

    EngineCore.run():  apply queued adds/aborts -> step() -> post(outputs, errors, SchedulerStats) -> ...

In its own process (`EngineCoreClient`, what `minivllm serve` uses) the loop never waits for the
GIL behind the HTTP server: the server sends requests down one pipe, in batches, and a thread of
its reads each step's outputs, packed into one message, from another.

    server process                                      engine-core process (spawned)
    generate() -> ops queue -> sender thread ==pipe==>  EngineCore.run(): read the pipe between steps,
    asyncio queues <- reader thread        <==pipe====                    step, pack outputs, send

vLLM: vllm/v1/engine/core.py (EngineCore, EngineCoreProc) and core_client.py (MPClient).
"""
import concurrent.futures
import gc
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from enum import IntEnum

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutdown); no request can be served."""


# ---- what goes to the engine loop (from other threads, or down the pipe from the server) ----
@dataclass
class AddRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class TakeStepTrace:
    """Send the step records since the last one (engine-core process only)."""


@dataclass
class Stop:
    """Abort what runs, shut the engine down, end the process."""


class CoreMessage(IntEnum):
    """What the engine-core process sends back, as (CoreMessage, payload)."""

    READY = 1  # payload None: built and warmed up
    FAILED = 2  # payload: the traceback text of a failed start
    STEP = 3  # payload: (packed outputs, {request id: exception}, SchedulerStats)
    TRACE = 4  # payload: the step records since the last TRACE (None if the trace is off)
    STOPPED = 5  # payload None: the loop has ended and the engine is shut down


@dataclass
class SchedulerStats:
    """The engine's queues and caches after a step, for /metrics (vLLM: vllm/v1/metrics/stats.py)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up, since the start
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decoding: object = None  # a copy of engine/spec_decode.py's SpecDecodingStats (None: off)

    @classmethod
    def of(cls, engine) -> "SchedulerStats":
        scheduler = engine.scheduler
        kv = scheduler.kv_cache_manager
        spec = getattr(scheduler, "spec_stats", None)
        return cls(len(scheduler.running), len(scheduler.waiting), kv.usage, kv.num_prompt_tokens_queried,
                   kv.num_cached_tokens_hit, scheduler.num_preemptions, spec and spec.copy())


class EngineCore:
    """Steps an LLMEngine while there is work; between steps applies what callers queued (adds,
    aborts, calls) from any thread. After every step with outputs, and after queued work, calls
    `post(outputs, errors, stats)` from the loop's thread; `errors` maps a request id to the
    exception that ends its stream (an add the engine refused, a failed step, shutdown)."""

    def __init__(self, engine, post):
        self.engine = engine
        self.post = post
        self._lock = threading.Lock()  # guards the inbox
        self._inbox: list = []  # AddRequest, AbortRequest, or a function to call, in arrival order
        self._wakeup = threading.Event()
        self._stopping = False

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams):
        self._queue(AddRequest(request_id, token_ids, params))

    def abort(self, request_id: str):
        self._queue(AbortRequest(request_id))

    def call(self, fn):
        """Run fn() in the loop's thread between steps (to read the engine safely)."""
        self._queue(fn)

    def _queue(self, op):
        with self._lock:
            self._inbox.append(op)
        self._wakeup.set()

    def stop(self):
        """Ask the loop to stop: the requests still running are aborted (their streams get
        EngineDeadError) and run() returns."""
        self._stopping = True
        self._wakeup.set()

    def run(self):
        engine = self.engine
        while not self._stopping:
            self._receive()
            applied, errors = self._take_inbox()
            if not engine.has_unfinished_requests():
                if applied:
                    self.post([], errors, SchedulerStats.of(engine))
                self._wait_for_work()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 (a failed step fails its requests, not the server)
                logger.exception("engine step failed; failing the running requests")
                errors.update(self._fail_running(e))
                outputs = []
            if outputs or errors or applied:
                self.post(outputs, errors, SchedulerStats.of(engine))
        _, errors = self._take_inbox()
        errors.update(self._fail_running(EngineDeadError("the engine has shut down")))
        self.post([], errors, SchedulerStats.of(engine))

    def _receive(self):
        """Bring queued work into the inbox (here other threads put it there themselves)."""

    def _wait_for_work(self):
        self._wakeup.wait(timeout=1.0)
        self._wakeup.clear()

    def _take_inbox(self) -> tuple[bool, dict[str, BaseException]]:
        """Apply queued adds, aborts and calls; an add the engine rejects fails that request alone."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        errors = {}
        for op in inbox:
            if isinstance(op, AbortRequest):
                self.engine.abort_request(op.request_id)
                errors.pop(op.request_id, None)
            elif isinstance(op, AddRequest):
                try:
                    self.engine.add_request(op.token_ids, op.params, request_id=op.request_id)
                except Exception as e:  # noqa: BLE001
                    errors[op.request_id] = e
            else:
                op()
        return bool(inbox), errors

    def _fail_running(self, error: BaseException) -> dict[str, BaseException]:
        """Abort every request in the engine; each one's stream gets `error`."""
        try:
            request_ids = self.engine.abort_all()
        except Exception:  # noqa: BLE001 (a broken engine: fail every request it still knows)
            logger.exception("could not abort the running requests")
            request_ids = list(self.engine.output_processor.requests)
        return dict.fromkeys(request_ids, error)


def warm_up(engine):
    """Run short requests through the paths a server's first requests take, so that kernels
    specialised on a shape (Triton specialises integer arguments equal to 1 or divisible by 16)
    compile now, not inside a client's first token: prefills of 1, 2, 3 and 16 prompts, all of a
    length divisible by 16 or all of odd lengths, their decodes, greedy and random sampling (with
    logprobs). Leaves no request behind and the prefix cache empty."""
    config = engine.config
    vocab_size = config.hf_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=4, ignore_eos=True, logprobs=1)
    room = max(1, config.max_model_len - greedy.max_tokens)
    for num_prompts in sorted({min(n, config.max_num_seqs) for n in (1, 2, 3, 16)}):
        for aligned in (True, False):
            for params in (greedy, sampled):
                for i in range(num_prompts):
                    length = min(room, 64 if aligned else 97 - 6 * i)
                    engine.add_request([(7 * i + j) % vocab_size for j in range(length)], params,
                                       request_id=f"warm-up-{num_prompts}-{aligned}-{i}")
                while engine.has_unfinished_requests():
                    engine.step()
    engine.reset_prefix_cache()


# ----------------------------------------------------------------------------- the engine in a process

@dataclass
class CoreOptions:
    """How the engine-core process starts."""

    warm_up: bool = True  # run `warm_up` before reporting ready (on CUDA only: nothing compiles on the CPU)
    step_trace: bool = False  # record a StepTrace from the start
    spawned_at: float | None = None  # time.time() when the server spawned the process (for the start-up log)


def prepare_engine(engine, options: CoreOptions):
    """Before the loop starts: warm up (on CUDA) and start the step trace, as `options` say."""
    if options.warm_up and engine.model_runner.device.type == "cuda":
        start = time.perf_counter()
        warm_up(engine)
        logger.info("engine warmed up with short requests in %.1f s", time.perf_counter() - start)
    if options.step_trace:
        engine.start_step_trace()


def _pack(outputs: list[RequestOutput]) -> list[tuple]:
    """A step's outputs as plain tuples, without the prompts (the server has them): a message of a
    few bytes per request to pickle, whatever the prompt length."""
    return [(o.request_id, o.finished, o.num_cached_tokens, o.prompt_logprobs,
             [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
              for c in o.outputs]) for o in outputs]


def _unpack(packed: list[tuple]) -> list[RequestOutput]:
    return [RequestOutput(request_id, None, None, [CompletionOutput(*c) for c in completions], finished,
                          num_cached_tokens, prompt_logprobs)
            for request_id, finished, num_cached_tokens, prompt_logprobs, completions in packed]


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


class _PipeEngineCore(EngineCore):
    """The loop of the engine-core process: between steps it reads the server's messages from the
    pipe itself (no second thread to compete with the loop for the GIL)."""

    def __init__(self, engine, post, input_conn, send_trace):
        super().__init__(engine, post)
        self.input_conn, self.send_trace = input_conn, send_trace

    def _receive(self, timeout: float = 0.0):
        try:
            while self.input_conn.poll(timeout):
                timeout = 0.0
                for op in self.input_conn.recv():
                    if isinstance(op, Stop):
                        self.stop()
                    elif isinstance(op, TakeStepTrace):
                        self.call(self.send_trace)
                    else:
                        self._queue(op)  # AddRequest, AbortRequest
        except (EOFError, OSError):  # the server is gone
            self.stop()

    def _wait_for_work(self):
        self._receive(timeout=1.0)


def run_engine_core(model: str, engine_kwargs: dict, options: CoreOptions, input_conn, output_conn):
    """The engine-core process: build the engine, warm it up, report ready, then serve the pipe
    until told to stop or the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    from minivllm.engine.llm_engine import LLMEngine, show_engine_logs

    show_engine_logs()

    start = time.perf_counter()
    if options.spawned_at is not None:  # a fresh interpreter importing torch and the engine: part of start-up
        logger.info("engine core process running %.1f s after it was spawned", time.time() - options.spawned_at)
    try:
        engine = LLMEngine(model, **engine_kwargs)
        logger.info("engine built in %.1f s", time.perf_counter() - start)
        prepare_engine(engine, options)
        # What the engine holds now lives until the end: keep it out of the garbage collector's
        # full collections, which would otherwise walk it all and stall a step.
        gc.collect()
        gc.freeze()
    except BaseException:  # noqa: BLE001 (reported to the server, which exits with it)
        output_conn.send((CoreMessage.FAILED, traceback.format_exc()))
        return
    logger.info("engine core ready in %.1f s", time.perf_counter() - start)
    output_conn.send((CoreMessage.READY, None))

    def post(outputs, errors, stats):
        payload = (_pack(outputs), {k: _picklable(e) for k, e in errors.items()}, stats)
        output_conn.send_bytes(pickle.dumps((CoreMessage.STEP, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def send_trace():
        trace = engine.step_trace
        output_conn.send((CoreMessage.TRACE, trace.take() if trace is not None else None))

    core = _PipeEngineCore(engine, post, input_conn, send_trace)
    try:
        core.run()
    finally:
        engine.shutdown()
        gc.unfreeze()  # let the interpreter's exit collect what start-up froze
        try:
            output_conn.send((CoreMessage.STOPPED, None))
        except OSError:
            pass


class EngineCoreClient:
    """The server's handle on an engine-core process. `add`/`abort` may be called from the event
    loop: they queue, and a sender thread writes what has queued as one pipe message. A reader
    thread calls `post(outputs, errors, stats)` for every step message, and
    `post([], {id: EngineDeadError}, None)` for every request still open if the process dies.

    Args:
        on_dead: called (from the reader thread) with an EngineDeadError when the process has gone.
    """

    def __init__(self, model: str, engine_kwargs: dict, post, on_dead, options: CoreOptions | None = None):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA cannot survive a fork
        self._input_read, self._input = context.Pipe(duplex=False)
        self._output, self._output_write = context.Pipe(duplex=False)
        # Not a daemon: the core starts worker processes of its own under tensor parallelism.
        options = replace(options or CoreOptions(), spawned_at=time.time())
        self.process = context.Process(target=run_engine_core, name="minivllm-engine-core",
                                       args=(model, engine_kwargs, options, self._input_read, self._output_write))
        self.process.start()
        self._input_read.close()
        self._output_write.close()
        self.post, self.on_dead = post, on_dead
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._traces: queue.SimpleQueue = queue.SimpleQueue()  # futures waiting for a step trace
        self._ready = False
        self._stopped = threading.Event()

    def wait_ready(self, timeout: float):
        """Block until the engine is built and warmed up; raise if it failed or took too long."""
        deadline = time.monotonic() + timeout
        while not self._output.poll(0.5):
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine-core process exited with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                self.shutdown(timeout=5)
                raise TimeoutError(f"the engine did not start within {timeout:.0f} s")
        kind, detail = self._output.recv()
        if kind is not CoreMessage.READY:
            self.process.join(30)
            raise RuntimeError(f"the engine failed to start:\n{detail}")
        self._ready = True
        threading.Thread(target=self._send_loop, name="minivllm-core-sender", daemon=True).start()
        threading.Thread(target=self._read_loop, name="minivllm-core-reader", daemon=True).start()

    @property
    def is_alive(self) -> bool:
        return self._ready and self.process.is_alive() and not self._stopped.is_set()

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams):
        self._ops.put(AddRequest(request_id, token_ids, params))

    def abort(self, request_id: str):
        self._ops.put(AbortRequest(request_id))

    def take_step_trace(self) -> concurrent.futures.Future:
        """The step records since the last call (None if the trace is off), as a future."""
        future = concurrent.futures.Future()
        self._traces.put(future)
        self._ops.put(TakeStepTrace())
        return future

    def stop(self):
        self._ops.put(Stop())

    def _send_loop(self):
        while True:
            ops = [self._ops.get()]
            while not self._ops.empty():
                ops.append(self._ops.get_nowait())
            try:
                self._input.send(ops)
            except (OSError, ValueError):  # the process is gone
                return
            if any(isinstance(op, Stop) for op in ops):
                return

    def _read_loop(self):
        try:
            while True:
                kind, payload = pickle.loads(self._output.recv_bytes())
                if kind is CoreMessage.STEP:
                    packed, errors, stats = payload
                    self.post(_unpack(packed), errors, stats)
                elif kind is CoreMessage.TRACE:
                    self._traces.get().set_result(payload)
                else:  # STOPPED
                    break
        except (EOFError, OSError):
            pass
        self._stopped.set()
        while not self._traces.empty():
            self._traces.get().set_result(None)
        self.on_dead(EngineDeadError("the engine has shut down"))

    def shutdown(self, timeout: float = 30.0):
        """Stop the loop (in-flight requests are aborted) and wait for the process to exit; kill it
        after `timeout` seconds, or at once if it is still starting."""
        if self.process.exitcode is None:
            if not self._ready:  # still starting: it reads no message before it is ready
                self.process.kill()
            self.stop()
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine-core process did not stop within %.0f s; killing it", timeout)
                self.process.kill()
                self.process.join(10)
        self._input.close()
