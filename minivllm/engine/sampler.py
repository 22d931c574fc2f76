"""The sampler layer: every SamplingParams feature on top of the core sampler, and the fused draw.

    penalties      presence / frequency / repetition rewrite the logits before temperature
    min_tokens     EOS and stop tokens banned until then (the core sampler does this too)
    seed           a seeded request draws the same tokens whatever shares its batch
    logprobs       the sampled token's and the top-k's raw log_softmax (engine/logprobs.py)
    the draw       on CUDA the Triton kernel of kernels/sampling.py: argmax(logits / T + Gumbel noise)
                   with per-row Philox seeds, greedy and temperature in one pass over the logits

A plain batch (no penalties, no logprobs, no top-k/top-p) runs one kernel on CUDA.
`FullSampler` is the ModelRunner layer that uses it (its `sample` and `to_output`).
vLLM: vllm/v1/sample/sampler.py, ops/penalties.py, ops/topk_topp_sampler.py.
"""
import hashlib
from dataclasses import dataclass, fields

import numpy as np
import torch

from minivllm.core.device import to_device
from minivllm.core.model_runner import Batch, ModelRunnerOutput
from minivllm.core.sampler import Sampler as CoreSampler
from minivllm.core.sampler import SamplingMetadata, apply_top_k_only, apply_top_k_top_p
from minivllm.engine.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs

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


@dataclass
class SamplingTensors(SamplingMetadata):
    """The core's per-row parameters, and what the other features need."""

    generators: list[torch.Generator | None] | None = None  # per row (CPU); None when no row is seeded
    seeds: torch.Tensor | None = None  # [batch] int64 Philox seeds (CUDA); None on CPU or all greedy
    penalties: "PenaltyTensors | None" = None  # None when no row uses a penalty
    max_num_logprobs: int | None = None  # the largest `logprobs` of the batch; None when no row asks

    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, device, eos_token_id: int | None = None,
                       generator: torch.Generator | None = None, last_tokens=None) -> "SamplingTensors":
        """Gather the batch's sampling parameters.

        Args:
            generator: CPU generator for the Philox seeds of unseeded rows (CUDA): the engine's
                own, seeded with its `seed`; None uses torch's default CPU generator.
            last_tokens: () -> [batch] int64 on the device: each row's last token (the step's input),
                which the penalties count; None: each sequence's last token id on the host.
        """
        device = torch.device(device)
        base = SamplingMetadata.from_sequences(seqs, vocab_size, device, eos_token_id)
        params = [seq.sampling_params for seq in seqs]
        generators = seeds = penalties = max_num_logprobs = None
        if uses_kernel_draw(device):  # no torch.Generator per seeded row: slow to create on CUDA
            if not base.all_greedy:
                seeds = to_device(_philox_seeds(seqs, generator), torch.int64, device)
        elif any(p.seed is not None and not p.is_greedy for p in params):
            generators = [seeded_generator(p.seed, seq.num_completion_tokens, device) if p.seed is not None else None
                          for seq, p in zip(seqs, params)]
        # One cheap pass decides; a plain batch (no penalties, no logprobs) does nothing more.
        extras = [p for p in params if p.logprobs is not None or p.uses_penalties]
        if extras:
            if any(p.uses_penalties for p in extras):
                penalties = PenaltyTensors.from_sequences(seqs, vocab_size, device, last_tokens and last_tokens())
            max_num_logprobs = max((p.logprobs for p in extras if p.logprobs is not None), default=None)
        return cls(**{f.name: getattr(base, f.name) for f in fields(SamplingMetadata)}, generators=generators,
                   seeds=seeds, penalties=penalties, max_num_logprobs=max_num_logprobs)


@dataclass
class PenaltyTensors:
    """What the penalties need of a batch: per-row weights and which tokens each row has seen.

        occurrences[b, v]: how often token v appears in row b's completion (presence, frequency)
        seen[b, v]:        token v appears in row b's prompt or completion (repetition)
    """

    presence_penalties: torch.Tensor  # [batch] float32, 0 = off
    frequency_penalties: torch.Tensor  # [batch] float32, 0 = off
    repetition_penalties: torch.Tensor  # [batch] float32, 1 = off
    occurrences: torch.Tensor  # [batch, vocab] float32
    seen: torch.Tensor  # [batch, vocab] bool

    @classmethod
    def from_sequences(cls, seqs, vocab_size: int, device, last_tokens: torch.Tensor | None = None) -> "PenaltyTensors":
        """last_tokens: [batch] each row's last token on the device (it may not have reached the
        host yet: async scheduling); None: the sequences' own last token ids."""
        params = [seq.sampling_params for seq in seqs]
        width = max(seq.num_tokens for seq in seqs)
        # [batch, width]: each row's tokens but the last, padded with vocab_size (an extra column,
        # dropped below); completion tokens also go to a second matrix for the counts.
        all_ids = np.full((len(seqs), width), vocab_size, dtype=np.int64)
        completion_ids = all_ids.copy()
        is_completion = np.zeros(len(seqs), dtype=bool)  # is the last token a completion token?
        for row, seq in enumerate(seqs):
            all_ids[row, :seq.num_tokens - 1] = seq.token_ids[:-1]
            completion_ids[row, seq.num_prompt_tokens:seq.num_tokens - 1] = seq.token_ids[seq.num_prompt_tokens:-1]
            is_completion[row] = seq.num_completion_tokens > 0
        if last_tokens is None:
            last_tokens = to_device([seq.last_token for seq in seqs], torch.int64, device)
        last = last_tokens.to(torch.int64).unsqueeze(1)  # [batch, 1]
        all_ids = torch.cat([to_device(all_ids, torch.int64, device), last], dim=1)
        pad = torch.full_like(last, vocab_size)
        completion_ids = torch.cat([to_device(completion_ids, torch.int64, device),
                                    torch.where(to_device(is_completion, torch.bool, device).unsqueeze(1), last, pad)], 1)
        shape = (len(seqs), vocab_size + 1)
        occurrences = torch.zeros(shape, dtype=torch.float32, device=device).scatter_add_(
            1, completion_ids, torch.ones(completion_ids.shape, dtype=torch.float32, device=device))
        seen = torch.zeros(shape, dtype=torch.bool, device=device).scatter_(1, all_ids, True)
        return cls(to_device([p.presence_penalty for p in params], torch.float32, device),
                   to_device([p.frequency_penalty for p in params], torch.float32, device),
                   to_device([p.repetition_penalty for p in params], torch.float32, device),
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


def _philox_seeds(seqs, generator: torch.Generator | None) -> list[int]:
    """Per row: a seeded request's seed for this step, else a fresh draw (host only, no device sync)."""
    fresh = torch.randint(SEED_BOUND - 1, (len(seqs),), generator=generator).tolist()
    return [derive_seed(seq.sampling_params.seed, seq.num_completion_tokens) if seq.sampling_params.seed is not None
            else seed for seq, seed in zip(seqs, fresh)]


class Sampler(CoreSampler):
    """The core sampler plus penalties, seeded rows and the kernel draw. On CUDA without
    top-k/top-p, one fused kernel; with them, torch ops filter and the kernel draws; on CPU torch
    ops, seeded rows from their own generators."""

    def forward(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """logits: [batch, vocab] float32, float16 or bfloat16. Returns [batch] int64 token ids."""
        if tensors.banned is not None:  # in the logits' own dtype: the kernel reads bf16 as is
            logits = logits.index_put(tuple(tensors.banned), torch.full((), float("-inf"), dtype=logits.dtype,
                                                                        device=logits.device))
        if tensors.penalties is not None:
            logits = apply_penalties(logits, tensors.penalties)
        if tensors.all_greedy:
            return logits.argmax(dim=-1)  # exact in any float dtype: no float32 copy
        kernel_draw = uses_kernel_draw(logits.device) and tensors.generators is None
        if kernel_draw:
            return self._kernel_draw(logits, tensors)
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        is_greedy = tensors.temperatures == 0  # (temperature 1 for them only to avoid dividing by 0)
        logits = _filter(logits / torch.where(is_greedy, 1.0, tensors.temperatures).unsqueeze(1), tensors)
        return torch.where(is_greedy, greedy_ids, self.random_sample(logits.softmax(dim=-1), tensors.generators))

    def _kernel_draw(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        from minivllm.kernels import sample_tokens

        seeds = tensors.seeds
        if seeds is None:
            seeds = torch.randint(SEED_BOUND - 1, tensors.temperatures.shape, device=logits.device)
        if tensors.top_ks is None and tensors.top_ps is None:  # the common case: one pass over the logits
            return sample_tokens(logits, tensors.temperatures.float(), seeds)
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        is_greedy = tensors.temperatures == 0
        logits = _filter(logits / torch.where(is_greedy, 1.0, tensors.temperatures).unsqueeze(1), tensors)
        # Temperature 1 on already scaled logits: bit for bit the fused path's scores, so a row's draw
        # does not depend on whether another row uses top-k/top-p.
        sampled = sample_tokens(logits, torch.ones_like(tensors.temperatures, dtype=torch.float32), seeds)
        return torch.where(is_greedy, greedy_ids, sampled)

    def random_sample(self, probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
        """The core's exponential race; a seeded row takes its noise from its own generator."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)  # [batch, vocab]
        for row, generator in enumerate(generators or []):
            if generator is not None:  # the row's own noise: independent of the rest of the batch
                q[row].exponential_(generator=generator)
        return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _filter(logits: torch.Tensor, tensors: SamplingMetadata) -> torch.Tensor:
    if tensors.top_ps is not None:
        return apply_top_k_top_p(logits, tensors.top_ks, tensors.top_ps)
    if tensors.top_ks is not None:
        return apply_top_k_only(logits, tensors.top_ks)
    return logits


@dataclass
class SamplerOutput:
    """A step's samples on the device (or their host copies: `to_host`)."""

    token_ids: torch.Tensor  # [num_sampled] int64
    logprobs: LogprobsTensors | None = None  # the sampled tokens' and the batch's top-k
    prompt_logprobs: dict[tuple[int, int], LogprobsTensors] | None = None  # (seq_id, first position) -> rows

    def to_host(self, pin: bool) -> "SamplerOutput":
        """Copies started toward the host (pinned and non-blocking on CUDA): valid once the stream
        has passed this point."""
        token_ids = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype, pin_memory=pin)
        token_ids.copy_(self.token_ids, non_blocking=pin)
        prompt = None if self.prompt_logprobs is None else {k: t.to_host(pin) for k, t in self.prompt_logprobs.items()}
        return SamplerOutput(token_ids, self.logprobs and self.logprobs.to_host(pin), prompt)


@dataclass
class SampledOutput(ModelRunnerOutput):
    """ModelRunnerOutput with what the outputs layer reads: per sampled row, (token ids, logprobs,
    rank of the sampled token) with the sampled token first and then the batch's top-k; and the
    prompt logprobs of the chunks that asked."""

    logprobs: list[tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: dict[tuple[int, int], LogprobsTensors] | None = None


class FullSampler:
    """ModelRunner layer: sample with `Sampler` (every feature), raw logprobs beside the samples."""

    def make_sampler(self) -> Sampler:
        return Sampler(self.generator if self.device.type == "cpu" else None)  # CUDA: Philox seeds instead

    def sample(self, out, batch: Batch, logits: torch.Tensor) -> SamplerOutput:
        tensors = SamplingTensors.from_sequences(out.sampled_seqs, logits.shape[-1], logits.device,
                                                 self.config.eos_token_id, self.generator,
                                                 lambda: batch.input_ids[batch.logits_indices])
        if tensors.max_num_logprobs is None:  # the plain path
            return SamplerOutput(self.sampler(logits, tensors))
        raw_logprobs = compute_logprobs(logits)  # before penalties and temperature (vLLM's raw logprobs)
        token_ids = self.sampler(logits, tensors)
        return SamplerOutput(token_ids, gather_logprobs(raw_logprobs, token_ids, tensors.max_num_logprobs))

    def to_output(self, sampled: SamplerOutput) -> SampledOutput:
        logprobs = None if sampled.logprobs is None else list(zip(*sampled.logprobs.tolists()))
        return SampledOutput(sampled.token_ids.tolist(), logprobs, sampled.prompt_logprobs)
