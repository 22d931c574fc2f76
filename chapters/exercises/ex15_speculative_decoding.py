"""Chapter 15 exercises: speculative decoding's two algorithms, the n-gram proposer that guesses the next
tokens and the rejection rule that keeps the guesses the target model agrees with. Write them;
`make exercise CH=15` runs the speculative-decoding tests with them (the algorithms alone, then the
engine generating with your code in it). Stuck? chapters/exercises/hints/15_speculative_decoding.md,
one level at a time.

15.1 replaces minivllm/engine/ngram_proposer.py's NgramProposer class and its helper _continue: the
engine builds NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max) from the
speculative config and calls propose(seq.token_ids) for each decoding sequence of a step. 15.2 replaces
rejection_sample of minivllm/engine/rejection_sampler.py, which the engine's verify step calls for its
sampled rows.
"""
from dataclasses import dataclass

import torch

from minivllm.engine.rejection_sampler import RejectionOutput


def _not_written(method: str) -> NotImplementedError:
    return NotImplementedError(f"exercise 15.1 (NgramProposer) is not written yet: NgramProposer.{method}; fill it "
                               "in, chapters/exercises/ex15_speculative_decoding.py; read "
                               "chapters/15_speculative_decoding.md, '2. Prompt lookup: the n-gram proposer'")


@dataclass(frozen=True)
class NgramProposer:
    """Exercise 15.1: the n-gram (prompt lookup) proposer (chapter 15, "2. Prompt lookup: the n-gram
    proposer"). Replaces NgramProposer of minivllm/engine/ngram_proposer.py.

    Its settings are the fields below (given: the engine builds it with these three, by position or
    by keyword); the proposer keeps no other state, and one proposer serves every sequence.
    """

    num_speculative_tokens: int  # k: the number of tokens a proposal holds
    prompt_lookup_min: int = 1  # the shortest suffix n-gram that may match
    prompt_lookup_max: int = 3  # the longest, tried first

    def __post_init__(self):
        """Check the settings when the proposer is built, so that a bad config fails at once with a
        clear message, not with wrong drafts later:
        - each of the three must be an int (not a bool, which Python counts as an int) and >= 1, else
          ValueError(f"{name} must be an integer >= 1, got {value!r}") with the field's name;
        - prompt_lookup_min must not exceed prompt_lookup_max, else a ValueError whose message says
          "prompt_lookup_min (...) must not exceed prompt_lookup_max (...)".
        """
        raise _not_written("__post_init__")

    def propose(self, token_ids) -> list[int]:
        """The draft tokens for one sequence.

        token_ids: the sequence's tokens so far, prompt then output (a list of ints; the last one is
        the token the next step feeds the model).
        Returns a list of Python ints: self.num_speculative_tokens of them, or [] without a match.

        - The suffix n-gram is token_ids[-n:]. Try n = self.prompt_lookup_max first, then n - 1, down
          to self.prompt_lookup_min; the first n whose suffix also occurs earlier in token_ids wins.
        - "Earlier" means an occurrence that ends before the last token: the suffix never matches
          itself, but an occurrence may overlap it. Of several earlier occurrences, the most recent one
          (the one that starts last) wins.
        - The proposal is the num_speculative_tokens tokens that followed that occurrence, continued
          past the end of token_ids as _continue (below) says.
        - No suffix of length >= prompt_lookup_min occurs earlier (or token_ids is too short for any):
          [] (the step is then a plain decode for this sequence).
        """
        raise _not_written("propose")


def _continue(tokens: list[int], start: int, k: int) -> list[int]:
    """Exercise 15.1: the k tokens that follow tokens[:start] if the text goes on repeating itself
    (propose calls it with start = the end of the match). Replaces ngram_proposer._continue.

    tokens: a list of ints; 0 < start < len(tokens). Where the k tokens run past the end of tokens,
    the text is taken to keep repeating with the period it shows: period = len(tokens) - start, and
    each token past the end equals the token `period` places before it. E.g. [1, 2, 3, 4, 1, 2, 3]
    with start 3 (a match of (1, 2, 3) at 0) and k = 5: 4, 1, 2, 3 follow, and then (period 4) 4:
    [4, 1, 2, 3, 4]. So a match always gives exactly k tokens.
    """
    raise NotImplementedError("exercise 15.1 (_continue) is not written yet: fill it in, "
                              "chapters/exercises/ex15_speculative_decoding.py; read "
                              "chapters/15_speculative_decoding.md, '2. Prompt lookup: the n-gram proposer'")


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, is_greedy: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> RejectionOutput:
    """Exercise 15.2: verify a batch of drafts, keeping each sequence's output distributed exactly as
    the target model's own sampling (chapter 15, "5. The rejection rule"). Replaces
    minivllm/engine/rejection_sampler.py's rejection_sample.

    Args:
        target_probs: [batch, k + 1, vocab] float: p_0..p_k, the target's distribution at each draft
            position and after the last one (rows past a sequence's num_draft_tokens + 1 are ignored).
        draft_token_ids: [batch, k] int64: d_0..d_{k-1} (entries past num_draft_tokens are ignored).
        num_draft_tokens: [batch] int64 in [0, k]: 0 is a plain decode (one token drawn from p_0).
        draft_probs: [batch, k, vocab] float: q_0..q_{k-1}, the distributions the drafts were drawn
            from, or None: each q_i is one-hot on d_i (an n-gram proposer, or a greedy draft model).
        is_greedy: [batch] bool, rows verified greedily (None: no row is greedy).
        generator: every random number comes from it (torch.rand / torch.multinomial take it).

    For each row, walk its drafts in order. A greedy row accepts d_i while it is argmax p_i. A
    sampled row accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)). The walk stops at the first
    rejection, or after the row's last draft. Then the row emits one more token: at a rejection at
    position i, a draw from normalize(max(p_i - q_i, 0)) (greedy rows: argmax p_i); after all its
    drafts were accepted, the bonus token, a draw from p_{num_draft_tokens} (greedy: its argmax).
    Were the residual max(p_i - q_i, 0) all zeros (float rounding only), draw from p_i instead.

    Returns RejectionOutput(token_ids, num_emitted, num_accepted):
        token_ids: [batch, k + 1] int64, row b's first num_emitted[b] entries are its emitted tokens,
            the accepted drafts then the extra token (what follows them does not matter);
        num_emitted: [batch] int64, num_accepted + 1;  num_accepted: [batch] int64.
    Work on whole tensors (a loop over the k positions is fine; none over the batch or the vocabulary).
    """
    raise NotImplementedError("exercise 15.2 (rejection_sample) is not written yet: fill it in, "
                              "chapters/exercises/ex15_speculative_decoding.py; read "
                              "chapters/15_speculative_decoding.md, '5. The rejection rule'")
