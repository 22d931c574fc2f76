"""The engine loop: tokenize, schedule, run the model, detokenize, stop, repeat.

    add_request(prompt) -> Sequence in the scheduler's waiting queue
    step():  SchedulerOutput = scheduler.schedule()
             token_ids        = model_runner.run(scheduler_output)        (one per sampled seq)
             finished         = scheduler.postprocess(sampled_seqs, token_ids)   (+ stop strings here)

vLLM: vllm/v1/engine/llm_engine.py; nano-vllm: nanovllm/engine/llm_engine.py.
"""
import logging
import time
from dataclasses import dataclass, fields

from minivllm.config import Config
from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

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
    request_id: int
    prompt: str | None
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    cut_at_stop_string: bool = False


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
        self._next_request_id = 0
        self._inflight = None  # (SchedulerOutput, StepHandle, start time) of a launched decode step
        self._last_step_end = 0.0

    # ---- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if not all(isinstance(t, int) for t in prompt):
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

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        self._check_running()
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        request = _Request(self._next_request_id, text, seq, IncrementalDetokenizer(self.tokenizer, token_ids))
        self._next_request_id += 1
        self._requests[seq.seq_id] = request
        return request.request_id

    def abort_all(self):
        if self._inflight is not None:
            self._collect_inflight()
        for request in self._requests.values():
            if not request.seq.is_finished:
                self.scheduler.finish(request.seq, "abort")
        self._requests.clear()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it.

        With async scheduling, a decode step returns before its tokens are known: the next call
        schedules and launches the following step first, then collects this one, so the host's
        bookkeeping overlaps the device's work:

            host:   schedule N+1 | launch N+1 | wait N, postprocess N | schedule N+2 | ...
            device: ...... step N ......| ....... step N+1 ....... | ... step N+2 ...
        """
        if self._inflight is not None:
            return self._step_after_prefill() if self._inflight[0].is_prefill else self._step_overlapped()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if self.config.async_scheduling:
            # Each sampled sequence's coming token is a placeholder until collected, so that the next
            # step can be scheduled (block bookkeeping needs the length) before the token is known.
            handle = self.model_runner.launch(out)
            for seq in out.sampled_seqs:
                seq.append_token(PLACEHOLDER_TOKEN_ID)
            self._inflight = (out, handle, start)
            return []
        token_ids = self.model_runner.run(out)
        return self._postprocess(out, token_ids, start)

    def _step_overlapped(self) -> list[RequestOutput]:
        out, handle, start = self._inflight
        # Overlap only a decode of exactly the in-flight sequences again; prompt chunks, new
        # prompts or a preemption next: drain first.
        if not self.scheduler.can_decode_without_preemption() or len(self.scheduler.running) != len(out.seqs):
            return self._collect_inflight()
        self._inflight = None
        next_start = time.perf_counter()
        next_out = self.scheduler.schedule()
        assert [s.seq_id for s in next_out.seqs] == [s.seq_id for s in out.seqs]
        # Step N's samples are step N+1's input ids: they never leave the device for that.
        next_handle = self.model_runner.launch(next_out, handle.token_ids)
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
            self._inflight = (SchedulerOutput.decodes(live), next_handle, next_start)
        return finished

    def _step_after_prefill(self) -> list[RequestOutput]:
        """A prefill is in flight: queue the next prefill behind it (prompt chunks, which wait for
        no sampled token), then collect it. Anything else first drains it: a decode, and with
        chunked prefill a mixed step (decode rows in flight, or a sequence ready to decode) so that
        decoding sequences advance every step."""
        if self._inflight[0].num_decodes or self._decodes_ready():
            return self._collect_inflight()
        next_start = time.perf_counter()
        next_out = self.scheduler.schedule_prefills()
        if not next_out.seqs:
            return self._collect_inflight()
        next_handle = self.model_runner.launch(next_out)
        finished = self._collect_inflight()
        for seq in next_out.sampled_seqs:
            seq.append_token(PLACEHOLDER_TOKEN_ID)
        self._inflight = (next_out, next_handle, next_start)
        return finished

    def _decodes_ready(self) -> bool:
        """Chunked prefill: is a running sequence waiting to decode (its last token known)? Then
        the next step must be a mixed one, scheduled after the in-flight step is collected; a
        prefill queued alone would stall it."""
        if not self.config.enable_chunked_prefill:
            return False
        return any(seq.num_uncomputed_tokens == 1 and seq.last_token != PLACEHOLDER_TOKEN_ID
                   for seq in self.scheduler.running)

    def _take_placeholders(self, out, handle) -> list[int]:
        """Wait for a launched step's tokens and take its sequences' placeholders back out."""
        token_ids = self.model_runner.collect(handle)
        for seq in out.sampled_seqs:
            assert seq.token_ids.pop() == PLACEHOLDER_TOKEN_ID
        return token_ids

    def _collect_inflight(self) -> list[RequestOutput]:
        """Finish the launched step without launching another (the pipeline drains)."""
        out, handle, start = self._inflight
        self._inflight = None
        return self._postprocess(out, self._take_placeholders(out, handle), start)

    def _postprocess(self, out, token_ids: list[int], start: float) -> list[RequestOutput]:
        finished = self.scheduler.postprocess(out.sampled_seqs, token_ids)
        for seq in out.sampled_seqs:
            if self._detokenize(self._requests[seq.seq_id]):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
        # Overlapped steps' intervals overlap: count each from the later of its start and the last end.
        end = time.perf_counter()
        self._count(out, end - max(start, self._last_step_end))
        self._last_step_end = end
        return [self._output(self._requests.pop(seq.seq_id)) for seq in finished]

    def _count(self, out, seconds: float):
        if out.is_prefill:  # a mixed step counts as prefill time; its decode tokens still count as decodes
            self.stats.num_prefill_tokens += out.num_prefill_tokens
            self.stats.num_decode_tokens += out.num_decodes
            self.stats.num_cached_prompt_tokens += out.num_cached_tokens
            self.stats.prefill_seconds += seconds
        else:
            self.stats.num_decode_tokens += out.num_batched_tokens
            self.stats.decode_seconds += seconds

    def _detokenize(self, request: _Request) -> bool:
        """Bring the request's text up to date when it has stop strings to look for (others are decoded
        once, when they finish: a decode per token per step costs more than the model step at large
        batches). True when a stop string appeared; the text is cut before it."""
        seq, detok = request.seq, request.detokenizer
        if not seq.sampling_params.stop or request.cut_at_stop_string:
            return False
        delta = detok.add_tokens(seq.completion_token_ids[len(detok.token_ids):])
        cut = check_stop_strings(detok.text, len(delta), seq.sampling_params.stop)
        if cut is None:
            return False
        detok.text = detok.text[:cut]
        request.cut_at_stop_string = True
        return True

    def _output(self, request: _Request) -> RequestOutput:
        seq, detok = request.seq, request.detokenizer
        if not request.cut_at_stop_string:
            detok.add_tokens(seq.completion_token_ids[len(detok.token_ids):])
        completion = CompletionOutput(index=0, text=request.detokenizer.text,
                                      token_ids=list(seq.completion_token_ids), finish_reason=seq.finish_reason)
        return RequestOutput(request_id=str(request.request_id), prompt=request.prompt,
                             prompt_token_ids=list(seq.prompt_token_ids), outputs=[completion], finished=True,
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
        return self._inflight is not None or not self.scheduler.is_finished()
