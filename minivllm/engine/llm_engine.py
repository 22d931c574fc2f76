"""The engine loop: tokenize, schedule, run the model, detokenize, stop, repeat.

    add_request(prompt) -> Sequence in the scheduler's waiting queue
    step():  SchedulerOutput = scheduler.schedule()
             token_ids        = model_runner.run(seqs, is_prefill)
             finished         = scheduler.postprocess(seqs, token_ids)   (+ stop strings here)
             -> RequestOutputs: finished requests, plus running ones that stream (output_kind)

vLLM: vllm/v1/engine/llm_engine.py; nano-vllm: nanovllm/engine/llm_engine.py.
"""
import logging
import time
from dataclasses import dataclass, fields, replace

from minivllm.config import Config
from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from minivllm.outputs import CompletionOutput, RequestOutput
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
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # one list shared by every output of the request
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    cut_at_stop_string: bool = False
    num_sent_tokens: int = 0  # DELTA outputs: completion tokens already handed out
    num_sent_chars: int = 0  # DELTA outputs: characters of text already handed out


def _show_engine_logs():
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
        config_fields = {f.name for f in fields(Config)}
        unknown = sorted(set(kwargs) - config_fields)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; valid ones: {sorted(config_fields)}")
        self.config = Config(model, **kwargs)
        _show_engine_logs()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        if self.config.eos_token_id is None:
            self.config.eos_token_id = self.tokenizer.eos_token_id
        self.model_runner = ModelRunner(self.config)  # resolves config.num_kvcache_blocks
        self.scheduler = Scheduler(self.config)
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}  # seq_id -> request
        self._request_id_to_request: dict[str, _Request] = {}
        self._next_request_id = 0
        self._pending_outputs: list[RequestOutput] = []  # of a step drained early (abort_request)
        self._inflight = None  # (SchedulerOutput, StepHandle, start time) of a launched decode step
        self._last_step_end = 0.0

    # ---- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not set(map(type, prompt)) <= {int}:  # map(type): fast on long prompts
            raise TypeError("a prompt must be a string or a list of token ids (ints)")
        return None, list(prompt)

    def validate_prompt(self, token_ids: list[int]):
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocab_size)")

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; the next steps schedule it.

        Args:
            prompt: a string or a list of token ids.
            sampling_params: how to sample and when to stop; its output_kind says what step() returns
                while the request runs.
            request_id: the caller's id for it (a server's), unique among unfinished requests; None
                picks one.
        Returns:
            The request id, which its RequestOutputs carry.
        """
        self._check_running()
        if request_id is None:
            request_id = self._new_request_id()
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        elif request_id in self._request_id_to_request:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        request = _Request(request_id, text, seq.prompt_token_ids, seq, IncrementalDetokenizer(self.tokenizer, token_ids))
        self._requests[seq.seq_id] = request
        self._request_id_to_request[request_id] = request
        return request_id

    def _new_request_id(self) -> str:
        while str(self._next_request_id) in self._request_id_to_request:  # a caller took it
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
        request = self._request_id_to_request.get(request_id)
        if request is None:
            return False
        if self._inflight is not None and any(seq is request.seq for seq in self._inflight[0].seqs):
            self._pending_outputs += self._collect_inflight()
        if request_id not in self._request_id_to_request:  # it finished in that step
            return False
        self.scheduler.finish(request.seq, "abort")
        self._remove(request)
        return True

    def _remove(self, request: _Request) -> _Request:
        del self._requests[request.seq.seq_id]
        del self._request_id_to_request[request.request_id]
        return request

    def abort_all(self):
        if self._inflight is not None:
            self._collect_inflight()
        for request in self._requests.values():
            if not request.seq.is_finished:
                self.scheduler.finish(request.seq, "abort")
        self._requests.clear()
        self._request_id_to_request.clear()
        self._pending_outputs.clear()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it, and of
        running requests that got new tokens unless their output_kind is FINAL_ONLY.

        With async scheduling, a decode step returns before its tokens are known: the next call
        schedules and launches the following step first, then collects this one, so the host's
        bookkeeping overlaps the device's work:

            host:   schedule N+1 | launch N+1 | wait N, postprocess N | schedule N+2 | ...
            device: ...... step N ......| ....... step N+1 ....... | ... step N+2 ...
        """
        pending, self._pending_outputs = self._pending_outputs, []
        if self._inflight is None and self.scheduler.is_finished():
            return pending
        return pending + self._step() if pending else self._step()

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._step_after_prefill() if self._inflight[0].is_prefill else self._step_overlapped()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if self.config.async_scheduling:
            # Each sequence's coming token is a placeholder until collected, so that the next step
            # can be scheduled (block bookkeeping needs the length) before the token is known.
            handle = self.model_runner.launch(out.seqs, out.is_prefill)
            for seq in out.seqs:
                seq.append_token(PLACEHOLDER_TOKEN_ID)
            self._inflight = (out, handle, start)
            return []
        token_ids = self.model_runner.run(out.seqs, out.is_prefill)
        return self._postprocess(out, token_ids, start)

    def _step_overlapped(self) -> list[RequestOutput]:
        if not self.scheduler.can_decode_without_preemption():  # prefills or preemption next: drain
            return self._collect_inflight()
        out, handle, start = self._inflight
        self._inflight = None
        next_start = time.perf_counter()
        next_out = self.scheduler.schedule()
        assert [s.seq_id for s in next_out.seqs] == [s.seq_id for s in out.seqs]
        # Step N's samples are step N+1's input ids: they never leave the device for that.
        next_handle = self.model_runner.launch(next_out.seqs, False, handle.token_ids)
        finished = self._postprocess(out, self._take_placeholders(out, handle), start)
        rows = [i for i, seq in enumerate(next_out.seqs) if not seq.is_finished]
        for i in rows:
            seq = next_out.seqs[i]
            # Step N+1 (queued) writes the KV of the token step N sampled: if that token filled a
            # block, later prefills (queued after it) may now hit the block.
            self.scheduler.block_manager.commit_full_block(seq)
            seq.append_token(PLACEHOLDER_TOKEN_ID)
        if rows:  # the rows of sequences that finished in step N are computed and discarded
            live = [next_out.seqs[i] for i in rows]
            if len(rows) < len(next_out.seqs):
                next_handle = next_handle.select(rows)
            self._inflight = (replace(next_out, seqs=live, num_batched_tokens=len(live)), next_handle, next_start)
        return finished

    def _step_after_prefill(self) -> list[RequestOutput]:
        """A prefill is in flight: queue the next prefill behind it (other sequences, so nothing
        waits for its tokens), then collect it. Anything else (a decode) first drains it."""
        next_start = time.perf_counter()
        next_out = self.scheduler.schedule_prefills()
        if not next_out.seqs:
            return self._collect_inflight()
        next_handle = self.model_runner.launch(next_out.seqs, True)
        finished = self._collect_inflight()
        for seq in next_out.seqs:
            seq.append_token(PLACEHOLDER_TOKEN_ID)
        self._inflight = (next_out, next_handle, next_start)
        return finished

    def _take_placeholders(self, out, handle) -> list[int]:
        """Wait for a launched step's tokens and take its sequences' placeholders back out."""
        token_ids = self.model_runner.collect(handle)
        for seq in out.seqs:
            assert seq.token_ids.pop() == PLACEHOLDER_TOKEN_ID
        return token_ids

    def _collect_inflight(self) -> list[RequestOutput]:
        """Finish the launched step without launching another (the pipeline drains)."""
        out, handle, start = self._inflight
        self._inflight = None
        return self._postprocess(out, self._take_placeholders(out, handle), start)

    def _postprocess(self, out, token_ids: list[int], start: float) -> list[RequestOutput]:
        self.scheduler.postprocess(out.seqs, token_ids)
        outputs = []
        for seq in out.seqs:
            request = self._requests[seq.seq_id]
            streams = seq.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY
            if self._detokenize(request, streams):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                outputs.append(self._make_output(self._remove(request)))
            elif streams:
                outputs.append(self._make_output(request))
        # Overlapped steps' intervals overlap: count each from the later of its start and the last end.
        end = time.perf_counter()
        self._count(out, end - max(start, self._last_step_end))
        self._last_step_end = end
        return outputs

    def _count(self, out, seconds: float):
        if out.is_prefill:
            self.stats.num_prefill_tokens += out.num_batched_tokens
            self.stats.num_cached_prompt_tokens += out.num_cached_tokens
            self.stats.prefill_seconds += seconds
        else:
            self.stats.num_decode_tokens += out.num_batched_tokens
            self.stats.decode_seconds += seconds

    def _detokenize(self, request: _Request, streams: bool) -> bool:
        """Bring the request's text up to date when it streams or has stop strings to look for
        (others are decoded once, when they finish: a decode per token per step costs more than the
        model step at large batches). True when a stop string appeared; the text is cut before it."""
        seq, detok = request.seq, request.detokenizer
        stop = seq.sampling_params.stop
        if not (stop or streams) or request.cut_at_stop_string:
            return False
        delta = detok.add_tokens(seq.token_ids[seq.num_prompt_tokens + len(detok.token_ids):])
        if not stop:
            return False
        cut = check_stop_strings(detok.text, len(delta), stop)
        if cut is None:
            return False
        detok.text = detok.text[:cut]
        request.cut_at_stop_string = True
        return True

    def _make_output(self, request: _Request) -> RequestOutput:
        """The request's RequestOutput now: all of it (finished, CUMULATIVE) or what is new (DELTA).

        While a request with stop strings runs, its last (longest stop string - 1) characters are
        held back: they may be the start of a stop string, which never appears in the text.
        """
        seq, detok = request.seq, request.detokenizer
        if not request.cut_at_stop_string:
            detok.add_tokens(seq.token_ids[seq.num_prompt_tokens + len(detok.token_ids):])
        params, text = seq.sampling_params, detok.text
        num_chars = len(text)
        if params.stop and not seq.is_finished:
            num_chars -= max(map(len, params.stop)) - 1
        if params.output_kind is RequestOutputKind.DELTA:
            first_char = request.num_sent_chars
            num_chars = max(num_chars, first_char)
            token_ids = seq.token_ids[seq.num_prompt_tokens + request.num_sent_tokens:]
            request.num_sent_chars, request.num_sent_tokens = num_chars, seq.num_completion_tokens
        else:
            first_char, num_chars, token_ids = 0, max(num_chars, 0), seq.completion_token_ids
        completion = CompletionOutput(index=0, text=text[first_char:num_chars], token_ids=token_ids,
                                      finish_reason=seq.finish_reason)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=seq.is_finished,
                             num_cached_tokens=seq.num_prompt_cached_tokens)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache so the next requests compute their prompts in full (benchmarks
        that repeat a workload). False, and nothing dropped, while requests are running."""
        return not self.has_unfinished_requests() and self.scheduler.block_manager.reset_prefix_cache()

    # ---- life cycle -------------------------------------------------------------------------------
    def shutdown(self):
        """Abort every request and release the KV cache, CUDA graphs and their pool, and the model's
        weights, so that `torch.cuda.memory_allocated()` is back where it was before the engine.
        Idempotent; the engine cannot generate afterwards."""
        runner = self.model_runner
        if runner is None:
            return
        try:
            self.abort_all()
        finally:
            self.model_runner = None
            runner.shutdown()

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
        return self._inflight is not None or not self.scheduler.is_finished() or bool(self._pending_outputs)
