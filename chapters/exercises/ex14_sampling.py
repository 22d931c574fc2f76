"""Chapter 14 exercises: the sampler's filters and the core sampler itself (minivllm/core/sampler.py).
Write the function and the class; `make exercise CH=14` runs the sampler's tests with them.
Stuck? chapters/exercises/hints/14_sampling.md, one level at a time.

14.1 replaces the module's apply_top_k_top_p (the engine's sampler layer calls it too); 14.2 replaces
the class Sampler of the core sampler: the core engine's ModelRunner builds one
(`Sampler(self.generator)`) and calls it on every step's logits.
Use torch operations on whole batches: no Python loop over rows or tokens.
"""
import torch
from torch import nn

from minivllm.core import sampler as core_sampler  # noqa: F401 (its filters, for your Sampler)
from minivllm.core.sampler import SamplingMetadata


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Exercise 14.1: set to -inf every logit outside the row's top-k, then outside its top-p
    nucleus (chapter 14, "From logits to one token").

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


class Sampler(nn.Module):
    """Exercise 14.2: the core sampler, a step's logits in and one token per row out (chapter 14, "From
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
         its logits by its temperature, then filters them (top-p given: core_sampler.apply_top_k_top_p,
         which also does top-k; only top-k given: core_sampler.apply_top_k_only, which is faster;
         through the module, so that your 14.1 is the one called when it is installed), takes the
         softmax and draws one token from it with random_sample.
    random_sample(probs) -> [batch] int64: token i of a row with probability probs[row, i] (float32
    rows, zeros where the filters cut; you may overwrite probs). Neither torch.multinomial nor a
    cumulative sum: the chapter's draw needs neither. A token of probability 0 is never drawn.
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        raise NotImplementedError("exercise 14.2 (Sampler) is not written yet: fill in Sampler.forward, "
                                  "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                                  "'From logits to one token'")

    def random_sample(self, probs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercise 14.2 (Sampler) is not written yet: fill in Sampler.random_sample, "
                                  "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                                  "'From logits to one token'")
