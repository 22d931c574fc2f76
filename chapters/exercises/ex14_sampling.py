"""Chapter 14 exercises: the sampler's filters and its draw (minivllm/core/sampler.py).
Write the three functions; `make exercise CH=14` runs the sampler's tests with them.
Stuck? chapters/exercises/hints/14_sampling.md, one level at a time.

14.1 and 14.2 replace the module's functions (the engine's sampler layer calls them too); 14.3
replaces the method Sampler.random_sample of the core sampler (`self.generator` is its noise).
Use torch operations on whole batches: no Python loop over rows or tokens.
"""
import torch


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


def apply_top_k_only(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Exercise 14.2: top-k alone, for the batches where no row uses top-p (chapter 14, "From logits
    to one token").

    logits: [batch, vocab] float; top_ks: [batch] int64, 1 <= k <= vocab. Keeps the logits >= the
    row's k-th largest (ties of the k-th all kept), the rest -inf; kept values unchanged.
    It runs on every sampled step with top-k, on vocabularies of 150,000 tokens: do not sort whole
    rows. Returns a new [batch, vocab] tensor.
    """
    raise NotImplementedError("exercise 14.2 (apply_top_k_only) is not written yet: fill it in, "
                              "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                              "'From logits to one token'")


def random_sample(self, probs: torch.Tensor) -> torch.Tensor:
    """Exercise 14.3: one token per row, token i of a row with probability probs[row, i] (chapter 14,
    "From logits to one token", the draw). Replaces Sampler.random_sample of minivllm/core/sampler.py.

    probs: [batch, vocab] float32, each row a distribution (zeros where the filters cut); you may
    overwrite it. Every random number comes from self.generator (a torch.Generator, or None for
    torch's default), so that an engine's draws depend on its own generator only. Use neither
    torch.multinomial nor a cumulative sum: the chapter's draw needs neither. A token of
    probability 0 is never drawn.
    Returns [batch] int64 token ids.
    """
    raise NotImplementedError("exercise 14.3 (random_sample) is not written yet: fill it in, "
                              "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                              "'From logits to one token'")
