"""The engine loop: tokenize, schedule, run the model, detokenize, stop, repeat.

    add_request(prompt) -> Sequence in the scheduler's waiting queue
    step():  SchedulerOutput = scheduler.schedule()
             token_ids        = model_runner.run(seqs, is_prefill)
             finished         = scheduler.postprocess(seqs, token_ids)   (+ stop strings here)

vLLM: vllm/v1/engine/llm_engine.py; nano-vllm: nanovllm/engine/llm_engine.py.
"""
import logging
import time
from dataclasses import dataclass, fields

from minivllm.config import Config
from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
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


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        config_fields = {f.name for f in fields(Config)}
        unknown = sorted(set(kwargs) - config_fields)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; valid ones: {sorted(config_fields)}")
        self.config = Config(model, **kwargs)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        if self.config.eos_token_id is None:
            self.config.eos_token_id = self.tokenizer.eos_token_id
        self.model_runner = ModelRunner(self.config)  # resolves config.num_kvcache_blocks
        self.scheduler = Scheduler(self.config)
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}  # seq_id -> request
        self._next_request_id = 0

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
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        request = _Request(self._next_request_id, text, seq, IncrementalDetokenizer(self.tokenizer, token_ids))
        self._next_request_id += 1
        self._requests[seq.seq_id] = request
        return request.request_id

    def abort_all(self):
        for request in self._requests.values():
            if not request.seq.is_finished:
                self.scheduler.finish(request.seq, "abort")
        self._requests.clear()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        token_ids = self.model_runner.run(out.seqs, out.is_prefill)
        finished = self.scheduler.postprocess(out.seqs, token_ids)
        for seq in out.seqs:
            if self._detokenize(self._requests[seq.seq_id]):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
        self._count(out, time.perf_counter() - start)
        return [self._output(self._requests.pop(seq.seq_id)) for seq in finished]

    def _count(self, out, seconds: float):
        if out.is_prefill:
            self.stats.num_prefill_tokens += out.num_batched_tokens
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

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()
