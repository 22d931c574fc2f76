"""Checking and tokenizing a request before it reaches the engine: what the API server can do in its
own process, without the engine (the engine runs the same checks again when it queues a request).

vLLM: vllm/v1/engine/processor.py (Processor), which the front end runs before handing a request
to the engine core.
"""
import numbers

from minivllm.config import Config
from minivllm.sampling_params import SamplingParams


def is_token_id(x) -> bool:
    """An int (numpy's too), but not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class InputProcessor:
    """Tokenizes prompts and checks prompts and sampling parameters against one engine's config."""

    def __init__(self, config: Config, tokenizer):
        self.config = config
        self.tokenizer = tokenizer  # None: token-id prompts only (skip_tokenizer_init)

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a prompt given as text, token ids, {"prompt": text}
        or {"prompt_token_ids": ids} (vLLM's TextPrompt / TokensPrompt)."""
        if isinstance(prompt, dict):
            prompt = _unpack_prompt_dict(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine was built with skip_tokenizer_init=True, "
                                 "so give token ids (a list of ints or {'prompt_token_ids': [...]})")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and set(map(type, prompt)) <= {int}:  # the common case, fast on long prompts
            return None, list(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_token_id(t) for t in prompt):
            return None, [int(t) for t in prompt]
        shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:57] + "..."
        raise TypeError(f"a prompt must be a string, a list of token ids (ints; bools are not token ids), "
                        f"{{'prompt': str}} or {{'prompt_token_ids': list[int]}}, got {shown}")

    def validate_prompt(self, token_ids: list[int]):
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len="
                             f"{self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocab_size)")

    def validate_params(self, params: SamplingParams):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # it is mutable: fields may have changed since construction
        vocab_size = self.config.hf_config.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}) (the model's vocab_size), "
                             f"got {params.stop_token_ids}")

    def validate_features(self, params: SamplingParams):
        """What this engine cannot do for a request (checked after its prompt)."""
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this engine was built with skip_tokenizer_init=True "
                             "(use stop_token_ids)")

    def check_request(self, prompt: str | list[int] | dict,
                      sampling_params: SamplingParams) -> tuple[str | None, list[int]]:
        """Everything about one request that can be wrong, checked without queuing it.

        Returns:
            The prompt's text (None for token ids) and its token ids.
        Raises:
            TypeError / ValueError naming the bad argument and what is allowed.
        """
        self.validate_params(sampling_params)
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        self.validate_features(sampling_params)
        return text, token_ids


def _unpack_prompt_dict(prompt: dict) -> str | list[int]:
    """{"prompt": text} or {"prompt_token_ids": ids} -> the text or the ids."""
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"a prompt dict's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        if not isinstance(prompt["prompt_token_ids"], (list, tuple)):
            raise TypeError("a prompt dict's 'prompt_token_ids' must be a list of ints, "
                            f"got {type(prompt['prompt_token_ids']).__name__}")
        return prompt["prompt_token_ids"]
    raise ValueError(f"a prompt dict must have the key 'prompt' (text) or 'prompt_token_ids' (a list of ints); "
                     f"got keys {sorted(keys)}")
