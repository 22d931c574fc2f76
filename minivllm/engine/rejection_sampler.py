"""Speculative decoding's rejection sampler: keep the draft tokens the target model agrees with, so
that every emitted token is distributed exactly as if the target had sampled it alone (Leviathan et
al., "Fast Inference from Transformers via Speculative Decoding"). vLLM: vllm/v1/sample/rejection_sampler.py.

For each sequence, k draft tokens d_0..d_{k-1} with the draft's probabilities q_i, and the target's
probabilities p_0..p_k for the k + 1 positions (after temperature, top-k, top-p: the distribution the
sampler would draw from):

    i = 0, 1, ...: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection
                   emit a token drawn from normalize(max(p_i - q_i, 0)) and stop
    all accepted:  emit a bonus token drawn from p_k

An n-gram proposer has no probabilities: q_i is one-hot on d_i, so d_i is accepted with probability
p_i(d_i) and a rejection draws from p_i without d_i. Greedy rows accept while argmax p_i == d_i and
then emit argmax p_i. A sequence emits 1 to k + 1 tokens a step.
"""
from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor  # [batch, k + 1] int64: row b's first num_emitted[b] entries are its tokens
    num_emitted: torch.Tensor  # [batch] int64, 1 <= num_emitted <= num_draft_tokens + 1
    num_accepted: torch.Tensor  # [batch] int64: draft tokens accepted (num_emitted - 1)

    def to_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.token_ids.cpu(), self.num_emitted.cpu().tolist())]


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, is_greedy: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> RejectionOutput:
    """Args:
        target_probs: [batch, k + 1, vocab] float, the target's distribution at each draft position and
            after the last one (rows past a sequence's own num_draft_tokens + 1 are ignored).
        draft_token_ids: [batch, k] int64 (entries past num_draft_tokens are ignored).
        num_draft_tokens: [batch] int64 in [0, k]: 0 is a plain decode (one token from p_0).
        draft_probs: [batch, k, vocab] the draft model's probabilities, or None for one-hot (n-gram).
        is_greedy: [batch] bool, rows that take the argmax (None: none).
        generator: the random stream (uniforms for acceptance, then the residual draws).
    """
    batch, k_plus_1, vocab = target_probs.shape
    k, device = k_plus_1 - 1, target_probs.device
    assert draft_token_ids.shape == (batch, k) and num_draft_tokens.shape == (batch,)
    p = target_probs.float()
    drafts = draft_token_ids.long().clamp(0, vocab - 1)
    positions = torch.arange(k, device=device)
    in_draft = positions[None, :] < num_draft_tokens[:, None]  # [batch, k]
    p_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [batch, k]: p_i(d_i)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else \
        draft_probs.float().gather(2, drafts[..., None]).squeeze(2)
    uniform = torch.rand(batch, k, device=device, generator=generator)
    accepted = uniform * q_draft < p_draft  # u < p / q without dividing by a q of 0
    if is_greedy is not None:
        greedy_accepted = p[:, :k].argmax(dim=2) == drafts
        accepted = torch.where(is_greedy[:, None], greedy_accepted, accepted)
    accepted &= in_draft
    # accepted prefix: up to the first rejection (or the end of the draft)
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)  # [batch]

    rows = torch.arange(batch, device=device)
    p_next = p[rows, num_accepted]  # [batch, vocab]: where the extra token is drawn
    rejected = num_accepted < num_draft_tokens
    residual = p_next.clone()
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, drafts[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs.float()[rows, at]
        residual = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    # a residual of all zeros can only come from rounding (p = q is never rejected): fall back to p
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_next)
    extra = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    if is_greedy is not None:
        extra = torch.where(is_greedy, p_next.argmax(dim=1), extra)

    token_ids = torch.cat([drafts, torch.zeros(batch, 1, dtype=torch.long, device=device)], dim=1)
    token_ids[rows, num_accepted] = extra
    return RejectionOutput(token_ids, num_accepted + 1, num_accepted)
