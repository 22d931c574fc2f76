"""From a step's sampled tokens to RequestOutputs: text, stop strings, logprobs, streaming kinds.

    StepResult --> per sampled sequence: its logprobs, its text (detokenizer), a stop string?
               --> RequestOutputs of the requests that finished, and of the streaming ones that
                   got tokens (CUMULATIVE: everything so far; DELTA: what is new; FINAL_ONLY: none
                   while they run)

A request runs n sequences (`n` samples); the output processor knows each request and its samples,
the engine core only sequences. vLLM: vllm/v1/engine/output_processor.py.
"""
import time
from dataclasses import dataclass, field

from minivllm.core.engine import StepResult
from minivllm.core.sequence import Sequence
from minivllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from minivllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class EngineStats:
    """Counters since the engine started (also shown by the progress bar)."""

    num_prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass
class Sample:
    """One of a request's n sequences, and what its CompletionOutput collects as it runs."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer or with detokenize=False
    cut_at_stop_string: bool = False
    logprobs: list[PositionLogprobs] | None = None  # when the request asks for logprobs
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # DELTA outputs: completion tokens already handed out
    num_sent_chars: int = 0  # DELTA outputs: characters of text already handed out
    finish_sent: bool = False  # DELTA outputs: the finish_reason has been handed out
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # so far, chunk by chunk


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    samples: list[Sample]
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(sample.seq.is_finished for sample in self.samples)


class OutputProcessor:
    """Turns StepResults into RequestOutputs; finishes a sequence through `finish(seq, "stop")` when a
    stop string appears in its text."""

    def __init__(self, tokenizer, finish):
        self.tokenizer, self.finish = tokenizer, finish
        self.requests: dict[str, Request] = {}  # request_id -> request, until it finishes
        self.samples: dict[int, tuple[Request, Sample]] = {}  # seq_id -> its request and sample
        self.collecting_prompt_logprobs: set[int] = set()  # seq_ids whose prompt logprobs are incomplete
        self.stats = EngineStats()
        self._last_step_end = 0.0

    def add_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                    seqs: list[Sequence]) -> Request:
        request = Request(request_id, prompt, list(token_ids), params, [])
        for index, seq in enumerate(seqs):
            detokenizer = (IncrementalDetokenizer(self.tokenizer, token_ids)
                           if self.tokenizer is not None and params.detokenize else None)
            sample = Sample(index, seq, detokenizer)
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            if params.prompt_logprobs is not None:
                self.collecting_prompt_logprobs.add(seq.seq_id)
            request.samples.append(sample)
            self.samples[seq.seq_id] = (request, sample)
        self.requests[request_id] = request
        return request

    def remove_request(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        for sample in request.samples if request is not None else ():
            self.samples.pop(sample.seq.seq_id, None)
            self.collecting_prompt_logprobs.discard(sample.seq.seq_id)
        return request

    def process(self, result: StepResult) -> list[RequestOutput]:
        """A step's RequestOutputs (its tokens are already appended to its sequences)."""
        out = result.scheduler_output
        self._record_logprobs(out, result.output)
        touched = {}  # request_id -> request with an output to give, in step order
        for seq in out.sampled_seqs:
            request, sample = self.samples[seq.seq_id]
            streams = request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY
            if self._detokenize(sample, streams):  # a stop string ended it
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.finish(seq, "stop")
            if seq.is_finished:
                del self.samples[seq.seq_id]
            if streams or seq.is_finished:
                touched[request.request_id] = request
        self._count(result, time.perf_counter())
        outputs = []
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
                outputs.append(self.make_output(request))
            elif request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self.make_output(request))
        return outputs

    def _count(self, result: StepResult, end: float):
        """Overlapped steps' intervals overlap: count each from the later of its start and the last end."""
        out, stats = result.scheduler_output, self.stats
        seconds = end - max(result.start_time, self._last_step_end)
        self._last_step_end = end
        if out.is_prefill:  # a mixed step counts as prefill time; its decode tokens still count as decodes
            stats.num_prefill_tokens += out.num_prefill_tokens
            stats.num_decode_tokens += sum(map(_num_tokens, result.output.sampled_token_ids[:out.num_decodes]))
            stats.num_cached_prompt_tokens += out.num_cached_tokens
            stats.prefill_seconds += seconds
        else:  # (with drafts a step emits 1 to k + 1 tokens per sequence)
            stats.num_decode_tokens += sum(map(_num_tokens, result.output.sampled_token_ids))
            stats.decode_seconds += seconds

    def _record_logprobs(self, out, output):
        """Keep each asking sequence's share of the step's logprobs (its k of the batch's top-k), and
        the prompt logprobs of its chunk; a prompt's are complete when its last token has run."""
        logprobs, prompt_logprobs = getattr(output, "logprobs", None), getattr(output, "prompt_logprobs", None)
        if logprobs is None and prompt_logprobs is None and not self.collecting_prompt_logprobs:
            return  # the plain path
        for (seq_id, first_position), tensors in (prompt_logprobs or {}).items():
            request, sample = self.samples[seq_id]
            del sample.prompt_logprobs[first_position:]  # a sequence preempted mid-prefill starts again at 0
            sample.prompt_logprobs += self._position_logprobs(tensors, request.sampling_params.prompt_logprobs)
        for seq in out.sampled_seqs:  # their prompts are done: the first of a request's samples gives them
            if seq.seq_id in self.collecting_prompt_logprobs:
                self.collecting_prompt_logprobs.discard(seq.seq_id)
                request, sample = self.samples[seq.seq_id]
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None] + sample.prompt_logprobs
        for row, seq in enumerate(out.sampled_seqs if logprobs is not None else ()):
            request, sample = self.samples[seq.seq_id]
            if sample.logprobs is None:
                continue
            entries = logprobs[row]
            if isinstance(entries, list):  # speculative decoding: one per new token, up to a stop among them
                entries = entries[:seq.num_completion_tokens - len(sample.logprobs)]
            else:
                entries = [entries]
            for ids, values, rank in entries:
                sample.logprobs.append(self._logprob_dict(ids, values, rank, seq.sampling_params.logprobs))
                sample.cumulative_logprob += values[0]

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

    def _detokenize(self, sample: Sample, streams: bool) -> bool:
        """Bring the sample's text up to date when its request streams or has stop strings to look
        for (others are decoded once, when they finish: a decode per token per step costs more than
        the model step at large batches). True when a stop string appeared; the text is cut before it."""
        seq, detok = sample.seq, sample.detokenizer
        stop = seq.sampling_params.stop
        if not (stop or streams) or detok is None or sample.cut_at_stop_string:
            return False
        new_ids = seq.token_ids[seq.num_prompt_tokens + len(detok.token_ids):]
        if not stop:
            detok.add_tokens(new_ids)
            return False
        # One token at a time when a step brought several (speculative decoding): the sequence ends
        # with the token that completes the stop string, as it would one token per step.
        for i in range(len(new_ids)):
            num_new_chars = len(detok.add_tokens(new_ids[i:i + 1]))
            found = find_stop_string(detok.text, num_new_chars, stop)
            if found is not None:
                del seq.token_ids[seq.num_tokens - len(new_ids) + i + 1:]
                detok.text = detok.text[:found[0]]
                seq.stop_reason = found[1]
                sample.cut_at_stop_string = True
                return True
        return False

    def make_output(self, request: Request) -> RequestOutput:
        """The RequestOutput of a request as it stands (finished when every sample is): all of it
        (FINAL_ONLY, CUMULATIVE), or what is new since the last output (DELTA: only the samples
        with something new). prompt_token_ids is the request's own list, shared by its outputs."""
        delta = request.sampling_params.output_kind is RequestOutputKind.DELTA
        completions = [c for c in (self._make_completion(sample, delta) for sample in request.samples) if c is not None]
        num_cached_tokens = request.samples[0].seq.num_prompt_cached_tokens or 0
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=completions,
                             finished=request.finished, num_cached_tokens=num_cached_tokens,
                             prompt_logprobs=request.prompt_logprobs)

    def _make_completion(self, sample: Sample, delta: bool) -> CompletionOutput | None:
        """One sample's CompletionOutput; None for a DELTA sample with nothing new.

        While a sample with stop strings runs, its last (longest stop string - 1) characters are
        held back: they may be the start of a stop string, which never appears in the text.
        """
        seq, detok = sample.seq, sample.detokenizer
        num_tokens = seq.num_completion_tokens  # (no placeholder: outputs are made between overlapped steps)
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


def _num_tokens(sampled) -> int:
    """A sequence's new tokens in a step: one id, or a list of them (a step that verified drafts)."""
    return len(sampled) if isinstance(sampled, list) else 1
