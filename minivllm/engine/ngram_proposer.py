"""Speculative decoding's n-gram proposer (prompt lookup): guess the next tokens by finding the
sequence's last n tokens earlier in its own prompt and output, and proposing what followed them there.
No model runs; on text that repeats itself (code, quotes, summaries) the guesses are often right.
vLLM: vllm/v1/spec_decode/ngram_proposer.py.

    tokens:   ... a b c d x y z ... a b c | ?      suffix "a b c" (n = 3) occurred earlier,
                      ^^^^^ ^^^^^ proposed:          followed by "d x y z": propose "d x" (k = 2)
"""
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens from the longest suffix n-gram, n from
    `prompt_lookup_max` down to `prompt_lookup_min`, that occurred earlier in the sequence."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    def propose(self, token_ids) -> list[int]:
        """The draft tokens for a sequence whose tokens so far (prompt + output) are `token_ids`: what
        followed the most recent earlier occurrence of its longest matching suffix n-gram (continued
        with the same period where it runs into the end), num_speculative_tokens of them; [] when no suffix of length >= prompt_lookup_min occurred
        before (the step is then a plain decode for this sequence)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            # windows that start early enough to be followed by at least one token (never the suffix itself)
            windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                return _continue(tokens.tolist(), int(matches[-1]) + n, self.num_speculative_tokens)
        return []


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """The k tokens that follow tokens[:start] if the text goes on repeating itself: a match that
    ends near the end (a period shorter than k, "a a a" or "x y x y") keeps its period past the end.

        tokens:   x y z x y | ?     match "x y" at 0, start 2:  z x y  then z x ... (period 3)
    """
    extended = list(tokens)
    for i in range(k):
        extended.append(extended[start + i])
    return extended[len(tokens):]
