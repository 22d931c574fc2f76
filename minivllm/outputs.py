"""What `LLM.generate` hands back: one RequestOutput per prompt, holding its CompletionOutputs.

vLLM: vllm/outputs.py (RequestOutput, CompletionOutput) and vllm/logprobs.py (Logprob), same field names.
"""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    rank: 1-based rank of the token in the vocabulary at that position (1 = most likely).
    decoded_token: the token's text (None when the engine has no tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the chosen token first, then the top-k (vLLM's SampleLogprobs element).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt.

    cumulative_logprob: sum of the generated tokens' logprobs (None unless logprobs were asked for).
    logprobs: per generated token, {token id: Logprob} for the sampled token and the top-k.
    finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", or None while running.
    stop_reason: the stop string or stop token id that ended it (None for EOS, length or running).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and what was generated for it (n completions, index 0..n-1).

    prompt_logprobs: per prompt token, {token id: Logprob} for that token and the top-k at its
        position; None for the first token (nothing predicts it). None unless asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None
