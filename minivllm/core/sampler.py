"""Turn each sampled sequence's last logits into its next token: greedy, temperature, top-k, top-p.

A draw is an exponential race, argmax(probs / q) with q ~ Exp(1), which samples `probs` exactly,
with the noise from the engine's own generator. (The engine's sampler layer adds penalties,
per-request seeds, min_tokens, logprobs and a fused Triton draw: minivllm/engine/sampler.py.)
vLLM: vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py; nano-vllm: nanovllm/layers/sampler.py.
"""
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.core.device import to_device


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one batch, on the logits' device."""

    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    top_ks: torch.Tensor | None  # [batch] int64, vocab size where off; None when no row uses top-k
    top_ps: torch.Tensor | None  # [batch] float32, 1 where off; None when no row uses top-p
    all_greedy: bool
    banned: torch.Tensor | None = None  # [2, n] int64 (row, token id) pairs that must not be sampled

    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, device: torch.device,
                       eos_token_id: int | None = None) -> "SamplingMetadata":
        params = [seq.sampling_params for seq in seqs]
        top_ks = top_ps = banned = None
        if any(p.top_k != -1 for p in params):
            top_ks = to_device([min(p.top_k, vocab_size) if p.top_k != -1 else vocab_size for p in params],
                               torch.int64, device)
        if any(p.top_p < 1.0 for p in params):
            top_ps = to_device([p.top_p for p in params], torch.float32, device)
        pairs = [(row, token_id) for row, seq in enumerate(seqs) for token_id in min_tokens_banned(seq, eos_token_id)]
        if pairs:
            banned = to_device(pairs, torch.int64, device).t()
        return cls(to_device([p.temperature for p in params], torch.float32, device), top_ks, top_ps,
                   all(p.is_greedy for p in params), banned)


def check_core_features(params) -> None:
    """What this sampler (and the core around it) leaves to the engine's layers is an error here,
    never silently ignored."""
    for p in params:
        extras = [name for name, on in (("seed", p.seed is not None), ("presence/frequency/repetition penalties",
                  p.uses_penalties), ("logprobs", p.logprobs is not None), ("prompt_logprobs", p.prompt_logprobs
                  is not None), ("stop strings", bool(p.stop)), ("n > 1", p.n > 1)) if on]
        if extras:
            raise ValueError(f"the core engine does not do {', '.join(extras)}: use minivllm.LLM, whose layers do")


def min_tokens_banned(seq, eos_token_id: int | None) -> list[int]:
    """The token ids seq may not sample yet: before min_tokens, EOS and its stop tokens (they would
    end it, as in vLLM)."""
    params = seq.sampling_params
    if seq.num_completion_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    return banned


class Sampler(nn.Module):
    """Batched sampling with torch ops. generator: where the noise comes from (the engine's own,
    so that two engines never draw from one another's stream); None: torch's default."""

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits: [batch, vocab]. Returns [batch] int64 token ids."""
        if metadata.banned is not None:
            logits = logits.index_put(tuple(metadata.banned), torch.full((), float("-inf"), dtype=logits.dtype,
                                                                         device=logits.device))
        if metadata.all_greedy:
            return logits.argmax(dim=-1)  # exact in any float dtype: no float32 copy
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        # Greedy rows get temperature 1 here only to avoid dividing by 0; their sample is discarded.
        is_greedy = metadata.temperatures == 0
        logits = logits / torch.where(is_greedy, 1.0, metadata.temperatures).unsqueeze(1)
        if metadata.top_ps is not None:
            logits = apply_top_k_top_p(logits, metadata.top_ks, metadata.top_ps)
        elif metadata.top_ks is not None:
            logits = apply_top_k_only(logits, metadata.top_ks)
        return torch.where(is_greedy, greedy_ids, self.random_sample(logits.softmax(dim=-1)))

    def random_sample(self, probs: torch.Tensor) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): token i wins with probability probs[i] (an exponential race)."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)  # [batch, vocab]
        # exponential_ can return exactly 0; 0/0 would be NaN and win argmax.
        return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    Top-k keeps the logits >= the row's k-th largest (ties at the k-th are kept, as apply_top_k_only
    and vLLM keep them). In descending order, token j survives top-p if the tokens before it hold
    less than p of the (top-k renormalized) probability: the smallest set whose total reaches p.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [batch, vocab]
    if top_ks is not None:
        kth_values = sorted_logits.gather(-1, (top_ks - 1).unsqueeze(1))  # [batch, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_values, float("-inf"))
    if top_ps is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # top_p == 1 keeps everything even when rounding pushes mass_before up to 1.
        outside = (mass_before >= top_ps.unsqueeze(1)) & (top_ps.unsqueeze(1) < 1.0)
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_ids, sorted_logits)


def apply_top_k_only(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: keep logits >= the row's k-th largest (ties at the k-th are kept)."""
    max_k = int(top_ks.max())  # one host sync; far cheaper than sorting the whole vocabulary
    top_values = logits.topk(max_k, dim=-1).values  # [batch, max_k], descending
    kth_values = top_values.gather(-1, (top_ks - 1).unsqueeze(1))  # [batch, 1]
    return logits.masked_fill(logits < kth_values, float("-inf"))
