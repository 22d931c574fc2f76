"""How one request wants its tokens chosen and when it should stop, checked at construction and again
when a request is added (`verify`: the object is mutable).

vLLM: vllm/sampling_params.py (SamplingParams); only the fields minivllm implements are here.
"""
import math
from dataclasses import dataclass
from enum import Enum


class RequestOutputKind(Enum):
    """What each RequestOutput of a running request carries (vLLM's names).

    CUMULATIVE: everything generated so far, every step.  DELTA: only what is new since the last
    output (what a stream sends).  FINAL_ONLY: one output, when the request finishes (the cheapest:
    no text is decoded while it runs).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

MAX_LOGPROBS = 20  # most top-k logprobs per token a request may ask for (vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules (vLLM's names and defaults).

    temperature: 0 means greedy (argmax); higher flattens the distribution.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = off).
    top_k: keep the k most likely tokens (-1 = off).
    max_tokens: most tokens to generate. min_tokens: EOS and stop_token_ids cannot end the request
        (and are not sampled) before this many tokens.
    ignore_eos: keep generating past the model's EOS token.
    stop: strings that end generation; they are not included in the text.
    stop_token_ids: extra token ids that end generation ("stop"), even with ignore_eos.
    seed: makes this request's samples reproducible whatever else shares the batch (with n > 1,
        sample i uses seed + i, as vLLM does).
    n: how many completions to generate for the prompt (they share its KV through the prefix cache).
    presence_penalty: subtracted from the logit of every token the completion already contains
        (> 0 favours new tokens). frequency_penalty: subtracted once per occurrence in the completion.
        Both count generated tokens only, in [-2, 2].
    repetition_penalty: for every token in the prompt or the completion, positive logits are divided
        by it and negative ones multiplied (> 1 discourages repetition; 1 = off), as transformers'
        RepetitionPenaltyLogitsProcessor.
    logprobs: return the log-probabilities of the sampled token and of the `logprobs` most likely
        tokens at each step (0: the sampled token only; None: none). They are the model's raw
        log-probabilities, log_softmax of its logits before temperature, penalties, top-k/top-p.
    prompt_logprobs: the same for every prompt token after the first (its logits are computed at
        every prompt position, so such a prompt does not read the prefix cache).
    output_kind: what `LLMEngine.step` returns while the request runs (see RequestOutputKind);
        `LLM.generate` returns only final outputs whatever the kind.
    detokenize: False: the outputs carry token ids and no text (the caller decodes them; the
        server's engine process leaves a stream's text to the server). Stop strings need text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Check every field (ValueError naming the field and its allowed values) and normalize
        `stop` / `stop_token_ids` to lists. The engine calls it again for each request it adds, so
        a field changed after construction is checked too."""
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)
        self._check_numbers()

    def _check_numbers(self):
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive int, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are looked for in the text)")

    @staticmethod
    def _normalize_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop must not contain the empty string")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN
