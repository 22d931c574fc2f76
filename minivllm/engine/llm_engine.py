"""The LLMEngine: requests in, RequestOutputs out, around the engine core.

    add_request(prompt, params) -> InputProcessor: tokens, checks -> n Sequences -> Engine.add
    step():  Engine.step() (schedule, run, append tokens; minivllm/core/engine.py)
             -> OutputProcessor: text, stop strings, logprobs -> RequestOutputs

Which layers the core runs with (CUDA graphs, async scheduling, tensor parallelism, ...) is decided
once, in assemble.py. vLLM: vllm/v1/engine/llm_engine.py.
"""
import logging
import os
import time
from dataclasses import fields, replace

from minivllm.config import Config
from minivllm.core.engine import Engine, StepResult
from minivllm.core.sequence import Sequence
from minivllm.engine.assemble import create_executor, scheduler_and_stepper
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.processor import InputProcessor
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


def show_engine_logs():
    """Show minivllm's INFO lines (KV cache size, CUDA-graph capture) unless the application has set
    up logging itself."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("minivllm %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class LLMEngine:
    """The engine. Use it as a context manager, or call `shutdown()`, to give its device memory back
    before the process ends (also done when it is garbage-collected):

        with LLM(model_dir) as llm:
            outputs = llm.generate(prompts)
    """

    model_runner = None  # set in __init__; None once shut down (or if construction failed)

    def __init__(self, model: str, **kwargs):
        start = time.perf_counter()
        config = make_config(model, **kwargs)
        show_engine_logs()
        self.tokenizer = load_tokenizer(config)
        logger.info("config and tokenizer read in %.1f s", time.perf_counter() - start)
        if config.eos_token_id is None and self.tokenizer is not None:  # the model's config names none
            config = replace(config, eos_token_id=self.tokenizer.eos_token_id)
        self.executor = create_executor(config)
        self.model_runner = getattr(self.executor, "model_runner", self.executor)  # rank 0's under tensor parallelism
        # The config as resolved: the KV cache's size is known once the runner has sized it.
        self.config = replace(config, num_kvcache_blocks=self.model_runner.num_kvcache_blocks)
        self.scheduler, stepper = scheduler_and_stepper(self.config)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.engine_core = Engine(self.scheduler, self.executor, stepper, self._on_result)
        self.step_trace = None  # start_step_trace() turns it on
        self._next_request_id = 0
        self._pending_outputs: list[RequestOutput] = []  # of a step drained early (abort_request)

    @property
    def stats(self):
        return self.output_processor.stats

    # ---- requests ---------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer the engine uses (the model's, or the `tokenizer` option's)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: it was built with skip_tokenizer_init=True")
        return self.tokenizer

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids): see InputProcessor.tokenize."""
        return self.input_processor.tokenize(prompt)

    def check_request(self, prompt: str | list[int] | dict,
                      sampling_params: SamplingParams) -> tuple[str | None, list[int]]:
        """InputProcessor.check_request (every check of one request, nothing queued), on a running engine."""
        self._check_running()
        return self.input_processor.check_request(prompt, sampling_params)

    def add_request(self, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Check a request (`check_request`) and queue it; nothing is queued when a check fails.

        With sampling_params.n > 1 the request runs n sequences; the later ones find the prompt's
        KV in the prefix cache (when it is on).

        Args:
            prompt: text, token ids, {"prompt": text} or {"prompt_token_ids": ids} (see `tokenize`).
            sampling_params: how to sample and when to stop; its output_kind says what step() returns
                while the request runs.
            request_id: the caller's id for it (a server's), unique among unfinished requests; None
                picks one.
        Returns:
            The request id, which its RequestOutputs carry.
        """
        if request_id is None:
            request_id = self._new_request_id()
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        elif request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, token_ids = self.check_request(prompt, sampling_params)
        seqs = [Sequence(token_ids, params, self.config.kvcache_block_size)
                for params in _params_per_sample(sampling_params)]
        for seq in seqs:  # the n sequences need the same blocks: if the first fits, they all do
            self.engine_core.add(seq)
        self.output_processor.add_request(request_id, text, token_ids, sampling_params, seqs)
        return request_id

    def _new_request_id(self) -> str:
        while str(self._next_request_id) in self.output_processor.requests:  # a caller took it
            self._next_request_id += 1
        self._next_request_id += 1
        return str(self._next_request_id - 1)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; it returns no further output.

        A step launched ahead (async scheduling) may hold the request: that step is collected first
        (its outputs come with the next step()), so no later step reads the freed blocks.
        Returns:
            False when no unfinished request has that id (finished already, or unknown).
        """
        request = self.output_processor.requests.get(request_id)
        if request is None:
            return False
        stepper = self.engine_core.stepper
        if stepper.has_inflight() and stepper.holds_any({sample.seq.seq_id for sample in request.samples}):
            self._pending_outputs += stepper.drain()
        request = self.output_processor.remove_request(request_id)
        if request is None:  # it finished in that step
            return False
        for sample in request.samples:
            if not sample.seq.is_finished:
                self.scheduler.finish(sample.seq, "abort")
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their ids."""
        if self.engine_core.stepper.has_inflight():
            self.engine_core.stepper.drain()
        aborted = list(self.output_processor.requests)
        for request_id in aborted:
            for sample in self.output_processor.remove_request(request_id).samples:
                if not sample.seq.is_finished:
                    self.scheduler.finish(sample.seq, "abort")
        self._pending_outputs.clear()
        return aborted

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it, and of
        running requests that got new tokens unless their output_kind is FINAL_ONLY.

        With async scheduling a step returns before its tokens are known: the next call launches
        the following step first, then collects this one and returns its outputs (AsyncStepper in
        async_scheduling.py), so the host's bookkeeping overlaps the device's work.

        Raises:
            Whatever the step raised (an exception, KeyboardInterrupt, out of memory). Every
            request is then aborted, its blocks freed and kept out of the prefix cache (see
            `_abort_after_failed_step`); the engine is ready for new requests.
        """
        pending, self._pending_outputs = self._pending_outputs, []
        if not self.engine_core.has_unfinished():
            return pending
        try:
            outputs = self.engine_core.step()
        except BaseException:
            self._abort_after_failed_step()
            raise
        return pending + outputs if pending else outputs

    def _on_result(self, result: StepResult) -> list[RequestOutput]:
        outputs = self.output_processor.process(result)
        if self.step_trace is not None:
            self.step_trace.collected(result, time.perf_counter())
        return outputs

    def _abort_after_failed_step(self):
        """A step stopped part-way: its sequences' KV may be half written while their full blocks
        are already registered in the prefix cache. Take the blocks of every running sequence (the
        only ones a step writes) out of the cache, then abort every request."""
        self.engine_core.stepper.discard()  # the tokens in flight are lost with the failure
        if self.step_trace is not None:
            self.step_trace.drop_launches()
        for seq in self.scheduler.running:
            self.scheduler.kv_cache_manager.uncache_blocks(seq)
        self.abort_all()

    def start_step_trace(self, max_steps: int = 200_000):
        """Record every step from now on (kind, batch, host and device time: see step_trace.py).
        Call it between steps, with no step in flight."""
        from minivllm.engine.step_trace import StepTrace, TracedExecutor

        if self.engine_core.stepper.has_inflight():
            raise RuntimeError("start_step_trace needs an engine with no step in flight")
        if self.step_trace is None:
            self.engine_core.stepper.executor = TracedExecutor(self.executor)  # CUDA events around every step
        self.step_trace = self.engine_core.stepper.executor.trace = StepTrace(
            self.model_runner.device.type == "cuda", max_steps,
            getattr(self.model_runner, "is_unified_mixed_step", lambda out: True))
        return self.step_trace

    def get_metrics(self) -> list:
        """The engine's metrics now, under vLLM's names (minivllm/engine/metrics_reader.py): queue
        lengths, KV-cache usage, prefix-cache and preemption counters, and with speculative decoding
        vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens (Counters, `.value`)
        and vllm:spec_decode_num_accepted_tokens_per_pos (a Vector, `.values`)."""
        from minivllm.engine.engine_core import SchedulerStats
        from minivllm.engine.metrics_reader import engine_metrics

        return engine_metrics(SchedulerStats.of(self), {"model_name": self.config.model})

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache so the next requests compute their prompts in full (benchmarks
        that repeat a workload). False, and nothing dropped, while requests are running."""
        return not self.has_unfinished_requests() and self.scheduler.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished() or bool(self._pending_outputs)

    # ---- life cycle -------------------------------------------------------------------------------
    def shutdown(self):
        """Abort every request and release the KV cache, CUDA graphs and their pool, and the model's
        weights, so that `torch.cuda.memory_allocated()` is back where it was before the engine; under
        tensor parallelism, stop the worker processes too. Idempotent; the engine cannot generate
        afterwards."""
        if self.model_runner is None:
            return
        try:
            self.abort_all()
        finally:
            self.model_runner = None
            self.executor.shutdown()
            if hasattr(getattr(self, "scheduler", None), "shutdown"):  # (a draft model: speculative decoding)
                self.scheduler.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    def _check_running(self):
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down; create a new LLM")


def make_config(model: str, **kwargs) -> Config:
    """The engine's Config; unknown option names are a TypeError that lists the valid ones."""
    config_fields = {f.name for f in fields(Config)}
    unknown = sorted(set(kwargs) - config_fields)
    if unknown:
        raise TypeError(f"unknown engine arguments {unknown}; valid ones: {sorted(config_fields)}")
    return Config(model, **kwargs)


def load_tokenizer(config: Config):
    """The engine's tokenizer (None with skip_tokenizer_init)."""
    return None if config.skip_tokenizer_init else _load_tokenizer(config.tokenizer)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str):
    # transformers builds an empty tokenizer from a directory without tokenizer files: refuse instead.
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{path!r} has no tokenizer files (any of {list(TOKENIZER_FILES)}); pass tokenizer=<a "
                         "tokenizer directory>, or skip_tokenizer_init=True to give token-id prompts")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _params_per_sample(params: SamplingParams) -> list[SamplingParams]:
    """The SamplingParams of each of a request's n sequences: sample i of a seeded request uses
    seed + i (as vLLM does), and only sample 0 computes the prompt's logprobs."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=params.seed + i if params.seed is not None else None,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(params.n)]
