"""What `LLM.generate` hands back: one RequestOutput per prompt, holding its CompletionOutputs.

vLLM: vllm/outputs.py (RequestOutput, CompletionOutput), same field names.
"""
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string), "length", or None while running

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and what was generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
