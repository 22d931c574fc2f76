"""Turn the last position's logits into one token per sequence: greedy, temperature, top-k, top-p.

Every draw is an exponential race, argmax(probs / q) with q ~ Exp(1), which samples `probs` exactly.
On CUDA the Triton kernel of kernels/sampling.py runs it in log space, argmax(logits / T + Gumbel
noise) with per-row Philox seeds, fused with greedy and temperature in one pass when no row uses
top-k/top-p (torch ops filter the logits first otherwise). On CPU torch ops run it, and a seeded
request takes its noise from its own torch generator.

Two extras run beside the draw, as torch ops, only in batches where some row asks for them (a plain
batch runs exactly the code above): presence/frequency/repetition penalties rewrite the logits
before temperature, and logprobs (the model's raw log_softmax, vLLM's default) are gathered for
the sampled tokens and the top-k.
vLLM: vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py; nano-vllm: nanovllm/layers/sampler.py.
"""
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID


SEED_BOUND = 1 << 63  # seeds are drawn in [0, 2**63): they fit an int64


def derive_seed(seed: int, step: int) -> int:
    """The 63-bit seed of step `step` of a request seeded with `seed`.

    Deriving it from (seed, step) instead of keeping one generator per request makes step i's
    draw the same whatever happened before (batching, preemption and recompute included).
    """
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (SEED_BOUND - 1)


def seeded_generator(seed: int, step: int, device: torch.device | str) -> torch.Generator:
    """The torch generator for step `step` of a request seeded with `seed` (the torch path)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, step))
    return generator


def uses_kernel_draw(device: torch.device | str) -> bool:
    """On CUDA the Triton kernel draws every sampled row, top-k/top-p batches included: a seeded
    row then gets the same tokens whatever else shares its batch."""
    return torch.device(device).type == "cuda"


def _to_device(values, dtype, device) -> torch.Tensor:
    """A small host list on the device without a host-device sync: a plain `torch.tensor(..., device=cuda)`
    copies from pageable memory and waits for the stream, which would stall async scheduling."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):  # torch cannot pin a tensor made from a numpy array in place
        return torch.from_numpy(values).to(dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, on the logits' device."""

    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    top_ks: torch.Tensor | None  # [batch] int64, vocab size where off; None when no row uses top-k
    top_ps: torch.Tensor | None  # [batch] float32, 1 where off; None when no row uses top-p
    generators: list[torch.Generator | None] | None  # per row (CPU); None when no row is seeded
    all_greedy: bool
    banned_rows: torch.Tensor | None = None  # [n] int64 } (row, token) pairs that must not be sampled:
    banned_token_ids: torch.Tensor | None = None  # [n] int64 } EOS / stop ids before min_tokens
    seeds: torch.Tensor | None = None  # [batch] int64 Philox seeds (CUDA); None on CPU or all greedy
    penalties: "PenaltyTensors | None" = None  # None when no row uses a penalty
    max_num_logprobs: int | None = None  # the largest `logprobs` of the batch; None when no row asks

    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, device, eos_token_id: int | None = None,
                       generator: torch.Generator | None = None,
                       input_ids: torch.Tensor | None = None) -> "SamplingTensors":
        """Gather the batch's sampling parameters.

        Args:
            generator: CPU generator for the Philox seeds of unseeded rows (CUDA): the engine's
                own, seeded with its `seed`; None uses torch's default CPU generator.
            input_ids: [batch] the step's input ids on the device, standing in for each sequence's
                last token when it is still a placeholder (async scheduling); penalties count them.
        """
        params = [seq.sampling_params for seq in seqs]
        temperatures = _to_device([p.temperature for p in params], torch.float32, device)
        top_ks = top_ps = generators = seeds = None
        if any(p.top_k != -1 for p in params):
            ks = [p.top_k if p.top_k != -1 else vocab_size for p in params]
            top_ks = _to_device(ks, torch.int64, device).clamp_(max=vocab_size)
        if any(p.top_p < 1.0 for p in params):
            top_ps = _to_device([p.top_p for p in params], torch.float32, device)
        all_greedy = all(p.is_greedy for p in params)
        if uses_kernel_draw(device):  # no torch.Generator per seeded row: slow to create on CUDA
            if not all_greedy:
                seeds = _to_device(_philox_seeds(seqs, generator), torch.int64, device)
        elif any(p.seed is not None and not p.is_greedy for p in params):
            generators = [seeded_generator(p.seed, seq.num_completion_tokens, device) if p.seed is not None else None
                          for seq, p in zip(seqs, params)]
        banned = [(row, token_id) for row, seq in enumerate(seqs) for token_id in _min_tokens_banned(seq, eos_token_id)]
        banned_rows = banned_ids = None
        if banned:
            banned_rows, banned_ids = _to_device(banned, torch.int64, device).unbind(1)
        penalties = max_num_logprobs = None
        # One cheap pass decides; a plain batch (no penalties, no logprobs) does nothing more.
        extras = [p for p in params if p.logprobs is not None or p.repetition_penalty != 1.0
                  or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if extras:
            if any(p.uses_penalties for p in extras):
                penalties = PenaltyTensors.from_sequences(seqs, vocab_size, device, input_ids)
            max_num_logprobs = max((p.logprobs for p in extras if p.logprobs is not None), default=None)
        return cls(temperatures, top_ks, top_ps, generators, all_greedy, banned_rows, banned_ids, seeds,
                   penalties, max_num_logprobs)


@dataclass
class PenaltyTensors:
    """What the penalties need of a batch: per-row weights and which tokens each row has seen.

        occurrences[b, v]: how often token v appears in row b's completion (presence, frequency)
        seen[b, v]:        token v appears in row b's prompt or completion (repetition)

    vLLM: vllm/v1/sample/ops/penalties.py and vllm/model_executor/layers/utils.py (apply_penalties).
    """

    presence_penalties: torch.Tensor  # [batch] float32, 0 = off
    frequency_penalties: torch.Tensor  # [batch] float32, 0 = off
    repetition_penalties: torch.Tensor  # [batch] float32, 1 = off
    occurrences: torch.Tensor  # [batch, vocab] float32
    seen: torch.Tensor  # [batch, vocab] bool

    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, device, input_ids: torch.Tensor | None = None) -> "PenaltyTensors":
        params = [seq.sampling_params for seq in seqs]
        width = max(seq.num_tokens for seq in seqs)
        # [batch, width]: each row's tokens, padded with vocab_size (an extra column, dropped below);
        # completion tokens also go to a second matrix for the counts.
        all_ids = np.full((len(seqs), width), vocab_size, dtype=np.int64)
        completion_ids = all_ids.copy()
        for row, seq in enumerate(seqs):
            all_ids[row, :seq.num_tokens] = seq.token_ids
            completion_ids[row, seq.num_prompt_tokens:seq.num_tokens] = seq.completion_token_ids
        assert input_ids is not None or not (all_ids == PLACEHOLDER_TOKEN_ID).any(), (
            "a placeholder token needs the step's input_ids to stand in for it")
        all_ids, completion_ids = _to_device(all_ids, torch.int64, device), _to_device(completion_ids, torch.int64, device)
        if input_ids is not None:  # a placeholder is the last token, whose id is on the device only
            pending = input_ids.to(torch.int64).unsqueeze(1)
            all_ids = torch.where(all_ids == PLACEHOLDER_TOKEN_ID, pending, all_ids)
            completion_ids = torch.where(completion_ids == PLACEHOLDER_TOKEN_ID, pending, completion_ids)
        shape = (len(seqs), vocab_size + 1)
        occurrences = torch.zeros(shape, dtype=torch.float32, device=device).scatter_add_(
            1, completion_ids, torch.ones(completion_ids.shape, dtype=torch.float32, device=device))
        seen = torch.zeros(shape, dtype=torch.bool, device=device).scatter_(1, all_ids, True)
        return cls(_to_device([p.presence_penalty for p in params], torch.float32, device),
                   _to_device([p.frequency_penalty for p in params], torch.float32, device),
                   _to_device([p.repetition_penalty for p in params], torch.float32, device),
                   occurrences[:, :vocab_size], seen[:, :vocab_size])


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """vLLM's penalties on [batch, vocab] logits (returns float32).

    repetition (tokens of prompt or completion): positive logits / r, negative ones * r, as
        transformers' RepetitionPenaltyLogitsProcessor;
    frequency: - f * (occurrences in the completion); presence: - p * (occurs in the completion).
    """
    logits = logits.float()
    repetition = penalties.repetition_penalties.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(penalties.seen, repeated, logits)
    logits = logits - penalties.frequency_penalties.unsqueeze(1) * penalties.occurrences
    return logits - penalties.presence_penalties.unsqueeze(1) * (penalties.occurrences > 0)


@dataclass
class LogprobsTensors:
    """Log-probabilities of chosen tokens and of the top-k, one row per position.

    vLLM: vllm/v1/outputs.py (LogprobsTensors).
    """

    logprob_token_ids: torch.Tensor  # [rows, 1 + k] int64: the chosen token, then the top-k
    logprobs: torch.Tensor  # [rows, 1 + k] float32
    ranks: torch.Tensor  # [rows] int64: the chosen token's 1-based rank in the vocabulary

    def to_host(self, pin: bool) -> "LogprobsTensors":
        """Copies started toward the host (pinned, non-blocking on CUDA): valid once the stream has
        passed this point (the step's event)."""
        copies = []
        for t in (self.logprob_token_ids, self.logprobs, self.ranks):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            copies.append(host.copy_(t, non_blocking=pin))
        return LogprobsTensors(*copies)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw logprobs: log_softmax of the model's logits in float32 (before any processing)."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks beside the top `num_logprobs` of every row.

    Args:
        logprobs: [rows, vocab] float32. token_ids: [rows] int64, the chosen token of each row.
    """
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [rows, 1]
    chosen = logprobs.gather(1, token_ids)  # [rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # ties count against the chosen token, as vLLM
    if num_logprobs == 0:
        return LogprobsTensors(token_ids, chosen, ranks)
    top = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(torch.cat([token_ids, top.indices], dim=1), torch.cat([chosen, top.values], dim=1), ranks)


def _philox_seeds(seqs, generator: torch.Generator | None) -> list[int]:
    """Per row: a seeded request's seed for this step, else a fresh draw (host only, no device sync)."""
    fresh = torch.randint(SEED_BOUND - 1, (len(seqs),), generator=generator).tolist()
    return [derive_seed(seq.sampling_params.seed, seq.num_completion_tokens) if seq.sampling_params.seed is not None
            else seed for seq, seed in zip(seqs, fresh)]


def _min_tokens_banned(seq, eos_token_id: int | None) -> list[int]:
    params = seq.sampling_params
    if seq.num_completion_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    return banned


class Sampler(nn.Module):
    """Batched sampling on the logits' device. On CUDA without top-k/top-p, one fused kernel; with
    them, torch ops filter and the kernel draws; on CPU torch ops, seeded rows one by one.

    generator: where the torch path draws the noise of unseeded rows (a generator on the logits'
    device; the engine passes its own on the CPU); None: torch's default generator.
    """

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None = None,
                top_ps: torch.Tensor | None = None, generators: list[torch.Generator | None] | None = None,
                all_greedy: bool = False, seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: [batch, vocab] float32, float16 or bfloat16.
            temperatures: [batch]; rows with 0 take the argmax.
            top_ks: [batch] int (vocab size = off) or None. top_ps: [batch] float (1 = off) or None.
            generators: per row, a torch.Generator on the logits' device for seeded rows, else None.
                Given, they draw (torch ops) instead of the kernel.
            all_greedy: the caller knows every row is greedy (skips the sampling work).
            seeds: [batch] int64 Philox seeds for the kernel draw (CUDA); None draws fresh ones.
        Returns:
            [batch] int64 token ids.
        """
        if all_greedy:
            return logits.argmax(dim=-1)  # exact in any float dtype: no float32 copy
        kernel_draw = uses_kernel_draw(logits.device) and generators is None
        if kernel_draw:
            from minivllm.kernels import sample_tokens

            if seeds is None:
                seeds = torch.randint(SEED_BOUND - 1, temperatures.shape, device=logits.device)
            if top_ks is None and top_ps is None:  # the common case: one pass over the logits
                return sample_tokens(logits, temperatures.float(), seeds)
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        # Greedy rows get temperature 1 here only to avoid dividing by 0; their sample is discarded.
        is_greedy = temperatures == 0
        logits = logits / torch.where(is_greedy, 1.0, temperatures).unsqueeze(1)
        if top_ps is not None:
            logits = apply_top_k_top_p(logits, top_ks, top_ps)
        elif top_ks is not None:
            logits = apply_top_k_only(logits, top_ks)
        if kernel_draw:
            # Temperature 1 on already scaled logits: bit for bit the fused path's scores, so a
            # row's draw does not depend on whether another row uses top-k/top-p.
            sampled_ids = sample_tokens(logits, torch.ones_like(temperatures, dtype=torch.float32), seeds)
        else:
            sampled_ids = self.random_sample(logits.softmax(dim=-1), generators)
        return torch.where(is_greedy, greedy_ids, sampled_ids)

    def sample(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """The engine's entry point: ban stop tokens under min_tokens, apply penalties, then `forward`."""
        if tensors.banned_rows is not None:  # in the logits' own dtype: the kernel reads bf16 as is
            logits = logits.index_put((tensors.banned_rows, tensors.banned_token_ids),
                                      torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
        if tensors.penalties is not None:
            logits = apply_penalties(logits, tensors.penalties)
        return self(logits, tensors.temperatures, tensors.top_ks, tensors.top_ps, tensors.generators,
                    tensors.all_greedy, tensors.seeds)

    def random_sample(self, probs: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): token i wins with probability probs[i] (an exponential race)."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)  # [batch, vocab]
        if generators is not None:
            for row, generator in enumerate(generators):
                if generator is not None:  # the row's own noise: independent of the rest of the batch
                    q[row].exponential_(generator=generator)
        # exponential_ can return exactly 0; 0/0 would be NaN and win argmax.
        return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    In descending order, token j survives top-p if the tokens before it hold less than p of the
    (top-k renormalized) probability: the smallest set whose total reaches p.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [batch, vocab]
    if top_ks is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks.unsqueeze(0) >= top_ks.unsqueeze(1), float("-inf"))
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
