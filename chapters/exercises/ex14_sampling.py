"""Chapter 14 exercise: the core sampler, from a step's logits to one token per row: the top-k and
top-p filters, the temperature, greedy rows and the draw (minivllm/core/sampler.py). Write the two
functions and the class; `make exercise CH=14` runs the sampler's tests with them.
Stuck? chapters/exercises/hints/14_sampling.md, one level at a time.

They replace apply_top_k_top_p, apply_top_k_only and the class Sampler of minivllm/core/sampler.py:
the core engine's ModelRunner builds your Sampler (`Sampler(self.generator)`) and calls it on every
step's logits, and the engine's sampler layer calls your filters too. Your Sampler calls your filters
(the functions of this file). Use torch operations on whole batches: no Python loop over rows or tokens.
"""
import torch
from torch import nn

from minivllm.core.sampler import SamplingMetadata


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Exercise 14.1, the filters: set to -inf every logit outside the row's top-k, then outside its
    top-p nucleus (chapter 14, "From logits to one token").

    logits: [batch, vocab] float; top_ks: [batch] int64 with 1 <= k <= vocab (k = vocab: top-k is off
    in that row), or None (off in every row); top_ps: [batch] float in (0, 1] (1: off), or None.

    Top-k keeps the logits >= the row's k-th largest: ties of the k-th logit are all kept.
    Top-p then works on what top-k kept, with the probabilities renormalized over it (its softmax):
    it keeps the smallest set of most likely tokens whose probabilities add up to at least p. In
    descending order of probability, token j survives if the tokens before it hold less than p.
    A row with p = 1 keeps every token top-k kept, even where float rounding makes a running total
    reach 1 before the last token.
    Kept logits keep their values exactly. Returns a new [batch, vocab] tensor; `logits` is not modified.
    """
    raise NotImplementedError("exercise 14.1 (apply_top_k_top_p) is not written yet: fill it in, "
                              "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                              "'From logits to one token'")


def apply_top_k_only(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Exercise 14.1, top-k alone: what apply_top_k_top_p(logits, top_ks, None) keeps, without sorting
    the whole vocabulary (the sampler's path when no row uses top-p; chapter 14, "From logits to one
    token").

    logits: [batch, vocab] float; top_ks: [batch] int64, 1 <= k <= vocab. Keeps the logits >= the row's
    k-th largest (ties of the k-th all kept), the others -inf. One host sync is allowed (reading the
    largest k of the batch). Returns a new tensor; `logits` is not modified.
    """
    raise NotImplementedError("exercise 14.1 (apply_top_k_only) is not written yet: fill it in, "
                              "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                              "'From logits to one token'")


class Sampler(nn.Module):
    """Exercise 14.1, the sampler: a step's logits in and one token per row out (chapter 14, "From
    logits to one token"). Replaces the class Sampler of minivllm/core/sampler.py.

    generator: a torch.Generator (or None: torch's default). Every random number of a draw comes from
    it, so that an engine's tokens depend on its own generator only: keep it as self.generator.

    forward(logits, metadata) -> [batch] int64 token ids. logits: [batch, vocab], any float dtype.
    metadata: a SamplingMetadata (same module): temperatures [batch] (0: greedy), top_ks / top_ps
    (None where no row filters), all_greedy, banned (None, or [2, n] int64: row ids, then token ids).
    In this order:
      1. banned (row, token) pairs can never be chosen, greedy rows included (min_tokens bans EOS so);
      2. all_greedy: each row's argmax, and nothing else to do (no copy to float32, no noise drawn);
      3. otherwise in float32: greedy rows (temperature 0) take their argmax; every other row divides
         its logits by its temperature, then filters them (top-p given: apply_top_k_top_p, which also
         does top-k; only top-k given: apply_top_k_only, which is faster; your functions above), takes
         the softmax and draws one token from it with random_sample.
    random_sample(probs) -> [batch] int64: token i of a row with probability probs[row, i] (float32
    rows, zeros where the filters cut; you may overwrite probs). Neither torch.multinomial nor a
    cumulative sum: the chapter's draw needs neither. A token of probability 0 is never drawn.
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        raise NotImplementedError("exercise 14.1 (Sampler) is not written yet: fill in Sampler.forward, "
                                  "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                                  "'From logits to one token'")

    def random_sample(self, probs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercise 14.1 (Sampler) is not written yet: fill in Sampler.random_sample, "
                                  "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                                  "'From logits to one token'")
