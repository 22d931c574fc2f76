"""Chapter 14 exercise: the top-k / top-p filter of the sampler (minivllm/core/sampler.py).
Write the function's body; `make exercise CH=14` runs the sampler's tests with it.
"""
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Exercise 14.1: set to -inf every logit outside the row's top-k, then outside its top-p
    nucleus (chapter 14, "From logits to one token").

    logits: [batch, vocab] float; top_ks: [batch] int64 (a row's k; k = vocab keeps all) or None;
    top_ps: [batch] float in (0, 1] or None.
    Top-k keeps each row's k largest logits. Top-p then keeps, in descending order of probability
    (the softmax of what top-k kept), the smallest set of tokens whose probabilities add up to at
    least p: token j survives if the tokens before it hold less than p. A row with p = 1 keeps
    everything (rounding must not drop its last tokens).
    Returns a new [batch, vocab] tensor (the caller samples from its softmax).
    Hint: sort each row once (logits.sort(dim=-1, descending=True)), mask in sorted order, and
    scatter the result back to the vocabulary order.
    """
    raise NotImplementedError("exercise 14.1 (apply_top_k_top_p) is not written yet: fill it in, "
                              "chapters/exercises/ex14_sampling.py; read chapters/14_sampling_and_outputs.md, "
                              "'From logits to one token'")
