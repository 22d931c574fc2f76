"""The engine loop: tokenize, schedule, run the model, detokenize, stop, repeat.

    add_request(prompt) -> Sequence in the scheduler's waiting queue
    step():  SchedulerOutput = scheduler.schedule()
             token_ids        = executor.run(scheduler_output)       (one device, or N ranks;
                                                                     one token per sampled seq)
             finished         = scheduler.postprocess(sampled_seqs, token_ids)   (+ stop strings here)
             -> RequestOutputs: finished requests, plus running ones that stream (output_kind)

That is the synchronous engine. With async_scheduling (on by default on CUDA) the same steps run
one ahead of their results, driven by async_scheduling.py's AsyncStepper.
vLLM: vllm/v1/engine/llm_engine.py; nano-vllm: nanovllm/engine/llm_engine.py.
"""
import logging
import os
import time
from dataclasses import dataclass, field, fields, replace

from minivllm.config import Config
from minivllm.engine.async_scheduling import AsyncScheduler, AsyncStepper
from minivllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from minivllm.engine.executor import create_executor
from minivllm.engine.processor import InputProcessor
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.step_trace import StepTrace, TracedExecutor
from minivllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("minivllm")


@dataclass
class EngineStats:
    """Counters since the engine started (also shown by the progress bar)."""

    num_prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class _Sample:
    """One of a request's n sequences, and what its CompletionOutput collects as it runs."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer (skip_tokenizer_init) or detokenize=False
    cut_at_stop_string: bool = False
    logprobs: list[PositionLogprobs] | None = None  # when the request asks for logprobs
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # DELTA outputs: completion tokens already handed out
    num_sent_chars: int = 0  # DELTA outputs: characters of text already handed out
    finish_sent: bool = False  # DELTA outputs: the finish_reason has been handed out
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # so far, chunk by chunk


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)


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
    async_stepper = None  # an AsyncStepper when async_scheduling is on

    def __init__(self, model: str, **kwargs):
        start = time.perf_counter()
        config = make_config(model, **kwargs)
        show_engine_logs()
        self.tokenizer = load_tokenizer(config)
        logger.info("config and tokenizer read in %.1f s", time.perf_counter() - start)
        if config.eos_token_id is None and self.tokenizer is not None:  # the model's config names none
            config = replace(config, eos_token_id=self.tokenizer.eos_token_id)
        self.executor = create_executor(config)
        self.model_runner = self.executor.model_runner  # rank 0's under tensor parallelism
        # The config as resolved: the KV cache's size is known once the runner has sized it.
        self.config = replace(config, num_kvcache_blocks=self.model_runner.num_kvcache_blocks)
        if self.config.async_scheduling:
            self.scheduler = AsyncScheduler(self.config)
            self.async_stepper = AsyncStepper(self.scheduler, self.executor, self._postprocess)
        else:
            self.scheduler = Scheduler(self.config)
            self.async_stepper = None
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}  # request_id -> request, until it finishes
        self._samples: dict[int, tuple[_Request, _Sample]] = {}  # seq_id -> its request and sample
        self._collecting_prompt_logprobs: set[int] = set()  # seq_ids whose prompt logprobs are incomplete
        self._next_request_id = 0
        self._pending_outputs: list[RequestOutput] = []  # of a step drained early (abort_request)
        self._last_step_end = 0.0
        self.step_trace: StepTrace | None = None  # start_step_trace() turns it on

    # ---- requests ---------------------------------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer the engine uses (the model's, or the `tokenizer` option's)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: it was built with skip_tokenizer_init=True")
        return self.tokenizer

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids): see InputProcessor.tokenize."""
        return self.input_processor.tokenize(prompt)

    def validate_prompt(self, token_ids: list[int]):
        self.input_processor.validate_prompt(token_ids)

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
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, token_ids = self.check_request(prompt, sampling_params)
        seqs = [Sequence(token_ids, params, self.config.kvcache_block_size)
                for params in _params_per_sample(sampling_params)]
        for seq in seqs:  # the n sequences need the same blocks: if the first fits, they all do
            self.scheduler.add(seq)
        request = _Request(request_id, text, list(token_ids), sampling_params, [])
        for index, seq in enumerate(seqs):
            detokenizer = (IncrementalDetokenizer(self.tokenizer, token_ids)
                           if self.tokenizer is not None and sampling_params.detokenize else None)
            sample = _Sample(index, seq, detokenizer)
            if sampling_params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            if sampling_params.prompt_logprobs is not None:
                self._collecting_prompt_logprobs.add(seq.seq_id)
            request.samples.append(sample)
            self._samples[seq.seq_id] = (request, sample)
        self._requests[request.request_id] = request
        return request.request_id

    def _new_request_id(self) -> str:
        while str(self._next_request_id) in self._requests:  # a caller took it
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
        request = self._requests.get(request_id)
        if request is None:
            return False
        if self._in_flight() and self.async_stepper.holds_any({sample.seq.seq_id for sample in request.samples}):
            self._pending_outputs += self.async_stepper.drain()
        if request_id not in self._requests:  # it finished in that step
            return False
        for sample in request.samples:
            self._samples.pop(sample.seq.seq_id, None)
            self._collecting_prompt_logprobs.discard(sample.seq.seq_id)
            if not sample.seq.is_finished:
                self.scheduler.finish(sample.seq, "abort")
        del self._requests[request_id]
        return True

    def abort_all(self) -> list[str]:
        """Abort every unfinished request; returns their ids."""
        if self._in_flight():
            self.async_stepper.drain()
        aborted = list(self._requests)
        for request in self._requests.values():
            for sample in request.samples:
                if not sample.seq.is_finished:
                    self.scheduler.finish(sample.seq, "abort")
        self._requests.clear()
        self._samples.clear()
        self._collecting_prompt_logprobs.clear()
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
        if not self._in_flight() and self.scheduler.is_finished():
            return pending
        try:
            outputs = self._step()
        except BaseException:
            self._abort_after_failed_step()
            raise
        return pending + outputs if pending else outputs

    def _abort_after_failed_step(self):
        """A step stopped part-way: its sequences' KV may be half written while their full blocks
        are already registered in the prefix cache. Take the blocks of every running sequence (the
        only ones a step writes) out of the cache, then abort every request."""
        if self.async_stepper is not None:
            self.async_stepper.discard()  # its tokens are lost with the failure
        if self.step_trace is not None:
            self.step_trace.drop_launches()
        for seq in self.scheduler.running:
            self.scheduler.block_manager.uncache_blocks(seq)
        self.abort_all()

    def _step(self) -> list[RequestOutput]:
        if self.async_stepper is not None:
            return self.async_stepper.step()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        handle = self.executor.launch(out)
        return self._postprocess(out, self.executor.collect(handle), start, handle)

    def start_step_trace(self, max_steps: int = 200_000) -> StepTrace:
        """Record every step from now on (kind, batch, host and device time: see step_trace.py).
        Call it between steps, with no step in flight."""
        if self._in_flight():
            raise RuntimeError("start_step_trace needs an engine with no step in flight")
        if self.step_trace is None:
            self.executor = TracedExecutor(self.executor)  # CUDA events around every launch
            if self.async_stepper is not None:
                self.async_stepper.executor = self.executor
        self.step_trace = self.executor.trace = StepTrace(self.model_runner.device.type == "cuda", max_steps,
                                                          self.model_runner.is_unified_mixed_step)
        return self.step_trace

    def _in_flight(self) -> bool:
        """Has async scheduling launched a step whose tokens are not collected yet?"""
        return self.async_stepper is not None and self.async_stepper.inflight is not None

    def _postprocess(self, out, token_ids: list[int], start: float, handle) -> list[RequestOutput]:
        """Append the step's tokens (one per sampled sequence) and logprobs, apply stop strings;
        return the outputs of the requests whose every sequence has finished, and of the streaming
        ones that got tokens."""
        self._record_logprobs(out, handle)
        self.scheduler.postprocess(out.sampled_seqs, token_ids)
        touched = {}  # request_id -> request with an output to give, in step order
        for seq in out.sampled_seqs:
            request, sample = self._samples[seq.seq_id]
            streams = request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY
            if self._detokenize(sample, streams):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                del self._samples[seq.seq_id]
            if streams or seq.is_finished:
                touched[request.request_id] = request
        # Overlapped steps' intervals overlap: count each from the later of its start and the last end.
        end = time.perf_counter()
        self._count(out, end - max(start, self._last_step_end))
        self._last_step_end = end
        if self.step_trace is not None:
            self.step_trace.collected(out, start, end, handle)
        outputs = []
        for request in touched.values():
            if request.finished:
                del self._requests[request.request_id]
                outputs.append(self._make_output(request))
            elif request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(request))
        return outputs

    def _record_logprobs(self, out, handle):
        """Keep each asking sequence's share of the step's logprobs (its k of the batch's top-k), and
        the prompt logprobs of its chunk; a prompt's are complete when its last token has run."""
        if handle.logprobs is None and handle.prompt_logprobs is None and not self._collecting_prompt_logprobs:
            return  # the plain path
        for (seq_id, first_position), tensors in (handle.prompt_logprobs or {}).items():
            request, sample = self._samples[seq_id]
            # A sequence preempted mid-prefill computes its prompt again from position 0.
            del sample.prompt_logprobs[first_position:]
            sample.prompt_logprobs += self._position_logprobs(tensors, request.sampling_params.prompt_logprobs)
        if self._collecting_prompt_logprobs:
            for seq in out.sampled_seqs:  # their prompts are done: the first of a request's samples gives them
                if seq.seq_id in self._collecting_prompt_logprobs:
                    self._collecting_prompt_logprobs.discard(seq.seq_id)
                    request, sample = self._samples[seq.seq_id]
                    if request.prompt_logprobs is None:
                        request.prompt_logprobs = [None] + sample.prompt_logprobs
        rows = handle.logprobs_lists()
        if rows is None:
            return
        for row, seq in enumerate(out.sampled_seqs):
            request, sample = self._samples[seq.seq_id]
            if sample.logprobs is not None:
                ids, logprobs, rank = rows[row]
                sample.logprobs.append(self._logprob_dict(ids, logprobs, rank, seq.sampling_params.logprobs))
                sample.cumulative_logprob += logprobs[0]

    def _position_logprobs(self, tensors, k: int) -> list[PositionLogprobs]:
        if tensors is None:  # a one-token prompt
            return []
        return [self._logprob_dict(ids, logprobs, rank, k) for ids, logprobs, rank in zip(*tensors.tolists())]

    def _logprob_dict(self, ids: list[int], logprobs: list[float], rank: int, k: int) -> PositionLogprobs:
        """{chosen token: Logprob, then the top k}; the chosen token keeps its place if it is in the top k."""
        decode = (lambda i: self.tokenizer.decode([i])) if self.tokenizer is not None else (lambda i: None)
        result = {ids[0]: Logprob(logprobs[0], rank, decode(ids[0]))}
        for j in range(1, k + 1):
            result.setdefault(ids[j], Logprob(logprobs[j], j, decode(ids[j])))
        return result

    def _count(self, out, seconds: float):
        if out.is_prefill:  # a mixed step counts as prefill time; its decode tokens still count as decodes
            self.stats.num_prefill_tokens += out.num_prefill_tokens
            self.stats.num_decode_tokens += out.num_decodes
            self.stats.num_cached_prompt_tokens += out.num_cached_tokens
            self.stats.prefill_seconds += seconds
        else:
            self.stats.num_decode_tokens += out.num_batched_tokens
            self.stats.decode_seconds += seconds

    def _detokenize(self, sample: _Sample, streams: bool) -> bool:
        """Bring the sample's text up to date when its request streams or has stop strings to look
        for (others are decoded once, when they finish: a decode per token per step costs more than
        the model step at large batches). True when a stop string appeared; the text is cut before it."""
        seq, detok = sample.seq, sample.detokenizer
        stop = seq.sampling_params.stop
        if not (stop or streams) or detok is None or sample.cut_at_stop_string:
            return False
        delta = detok.add_tokens(seq.token_ids[seq.num_prompt_tokens + len(detok.token_ids):])
        if not stop:
            return False
        found = find_stop_string(detok.text, len(delta), stop)
        if found is None:
            return False
        detok.text = detok.text[:found[0]]
        seq.stop_reason = found[1]
        sample.cut_at_stop_string = True
        return True

    def _make_output(self, request: _Request) -> RequestOutput:
        """The RequestOutput of a request as it stands (finished when every sample is): all of it
        (FINAL_ONLY, CUMULATIVE), or what is new since the last output (DELTA: only the samples
        with something new). prompt_token_ids is the request's own list, shared by its outputs."""
        delta = request.sampling_params.output_kind is RequestOutputKind.DELTA
        completions = []
        for sample in request.samples:
            completion = self._make_completion(sample, delta)
            if completion is not None:
                completions.append(completion)
        num_cached_tokens = request.samples[0].seq.num_prompt_cached_tokens or 0
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions,
                             finished=request.finished, num_cached_tokens=num_cached_tokens,
                             prompt_logprobs=request.prompt_logprobs)

    def _make_completion(self, sample: _Sample, delta: bool) -> CompletionOutput | None:
        """One sample's CompletionOutput; None for a DELTA sample with nothing new.

        While a sample with stop strings runs, its last (longest stop string - 1) characters are
        held back: they may be the start of a stop string, which never appears in the text.
        """
        seq, detok = sample.seq, sample.detokenizer
        num_tokens = seq.num_completion_tokens  # (no placeholder: outputs are made between async steps)
        text = ""
        if detok is not None:
            if not sample.cut_at_stop_string:
                detok.add_tokens(seq.token_ids[seq.num_prompt_tokens + len(detok.token_ids):
                                               seq.num_prompt_tokens + num_tokens])
            text = detok.text
        num_chars = len(text)
        stop = seq.sampling_params.stop
        if stop and not seq.is_finished:
            num_chars = max(num_chars - max(map(len, stop)) + 1, 0)
        first_token = first_char = 0
        if delta:
            if num_tokens == sample.num_sent_tokens and (sample.finish_sent or not seq.is_finished):
                return None
            first_token, first_char = sample.num_sent_tokens, sample.num_sent_chars
            num_chars = max(num_chars, first_char)
            sample.num_sent_tokens, sample.num_sent_chars = num_tokens, num_chars
            sample.finish_sent = seq.is_finished
        start = seq.num_prompt_tokens
        return CompletionOutput(
            index=sample.index, text=text[first_char:num_chars],
            token_ids=seq.token_ids[start + first_token:start + num_tokens],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs[first_token:num_tokens] if sample.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache so the next requests compute their prompts in full (benchmarks
        that repeat a workload). False, and nothing dropped, while requests are running."""
        return not self.has_unfinished_requests() and self.scheduler.block_manager.reset_prefix_cache()

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

    def has_unfinished_requests(self) -> bool:
        return self._in_flight() or not self.scheduler.is_finished() or bool(self._pending_outputs)


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
