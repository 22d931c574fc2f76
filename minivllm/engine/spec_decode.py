"""Speculative decoding as a layer of the engine: propose k tokens per decoding sequence, let the
target model score all of them in one forward, keep the ones it agrees with.

    schedule():  the core's step, then drafts for its decode rows (the n-gram proposer, or a draft
                 model: draft_model.py), each within the step's token budget, its KV slots
                 allocated now:
                     decode row:  [ last | d1 d2 d3 d4 ]    5 positions, one verify forward
    the runner:  a step of decodes verifies as decode rows, one per position (each row a decode
                 of its own: its token, its position, the keys before it through the same block
                 table; the step stores all rows' KV before any attends), so it runs the decode
                 kernel and its CUDA graphs; a step with a prompt chunk verifies as a prefill-style
                 step (q_len = 1 + k per row). Logits at every position; the rejection rule
                 (rejection_sampler.py) keeps d1..da and adds one token of the target's own
    update:      append the 1..k+1 tokens, stop at EOS / max_tokens inside them; the KV of the
                 accepted drafts stays, rejected slots are overwritten later
                 (num_computed_tokens = num_tokens - 1), so they never reach the prefix cache
    stepping:    a step with drafts waits for its tokens (the next drafts depend on them); with
                 async scheduling on, steps without drafts (more than `disable_by_batch_size`
                 decoding sequences) still run one ahead (SpecAsyncStepper)

A sequence whose request uses penalties, seeds, logprobs or min_tokens not yet reached decodes
without drafts in this version (its tokens are then exactly those of plain decoding); so does every
sequence when more than `disable_by_batch_size` run (drafts stop paying at large batches).
vLLM: vllm/v1/spec_decode/ (ngram_proposer.py, metrics.py), vllm/v1/core/sched/scheduler.py
(spec_token_ids), vllm/v1/sample/rejection_sampler.py.
"""
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from minivllm.config import SpeculativeConfig  # noqa: F401 (documented here: the layer's options)
from minivllm.core.device import to_device
from minivllm.core.engine import StepResult
from minivllm.core.model_runner import ModelRunnerOutput
from minivllm.core.sampler import SamplingMetadata
from minivllm.core.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID, AsyncScheduler, AsyncStepper, InflightStep
from minivllm.engine.async_scheduling import add_placeholders
from minivllm.engine.ngram_proposer import NgramProposer
from minivllm.engine.rejection_sampler import rejection_sample
from minivllm.engine.sampler import _filter

@dataclass
class SpecDecodingStats:
    """Counters since the start, vLLM's spec_decode metrics (vllm/v1/spec_decode/metrics.py)."""

    num_spec_tokens: int
    num_drafts: int = 0  # sequence-steps that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int):
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified sequence-step: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class SpecSchedulerOutput(SchedulerOutput):
    """The core's step plus each sequence's draft tokens ([] for prompt chunks and undrafted rows);
    num_scheduled_tokens of a drafted decode row is 1 + len(its drafts)."""

    spec_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def has_drafts(self) -> bool:
        return any(self.spec_token_ids)


def drafts_allowed(params) -> bool:
    """Requests whose sampling in this version needs one token per step: they decode without drafts."""
    return params.seed is None and not params.uses_penalties and params.logprobs is None


class SpecDecodeScheduler(Scheduler):
    """The core scheduler plus drafts for the decode rows (see the module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self.spec_config = config.spec_config
        self.proposer = make_proposer(config)
        self.spec_stats = SpecDecodingStats(self.spec_config.num_speculative_tokens)

    def schedule(self) -> SpecSchedulerOutput:
        out = super().schedule()
        drafts = [[] for _ in out.seqs]
        if self._step_may_draft(out):
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            rows, rooms = [], []
            for i, seq in enumerate(out.seqs[:out.num_decodes]):
                room = min(budget, self._room(seq))
                if room > 0:
                    rows.append(i)
                    rooms.append(room)
                    budget -= room
            proposals = self.proposer.propose_batch([out.seqs[i] for i in rows], rooms) if rows else []
            for i, proposal in zip(rows, proposals):  # (no blocks left for a proposal: a plain decode)
                if proposal and self.kv_cache_manager.allocate_slots(out.seqs[i], len(proposal)):
                    drafts[i] = proposal
        num_tokens = [n + len(d) for n, d in zip(out.num_scheduled_tokens, drafts)]
        return SpecSchedulerOutput(out.seqs, num_tokens, out.num_decodes, out.sampled_seqs, out.num_cached_tokens,
                                   drafts)

    def shutdown(self) -> None:
        """Release the proposer's device memory (a draft model's weights and KV cache)."""
        self.proposer.shutdown()

    def drafts_at(self, num_decodes: int) -> bool:
        """Does a step of `num_decodes` decoding sequences carry drafts (disable_by_batch_size)?"""
        limit = self.spec_config.disable_by_batch_size
        return num_decodes > 0 and (limit is None or num_decodes <= limit)

    def _step_may_draft(self, out: SchedulerOutput) -> bool:
        if not self.drafts_at(out.num_decodes):
            return False
        # prompt logprobs of a chunk in the same step are laid out by rows of one token per decode
        return all(seq.sampling_params.prompt_logprobs is None or seq.num_completion_tokens > 0 for seq in out.seqs)

    def _room(self, seq) -> int:
        """How many drafts seq may carry this step: the step emits up to drafts + 1 tokens, never
        past max_tokens or max_model_len (0: none for this request)."""
        params = seq.sampling_params
        if not drafts_allowed(params) or seq.num_completion_tokens < params.min_tokens:
            return 0
        if seq.last_token == PLACEHOLDER_TOKEN_ID:  # (a step ahead of its tokens: never drafted)
            return 0
        return min(self.spec_config.num_speculative_tokens, params.max_tokens - seq.num_completion_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def update_from_output(self, out: SchedulerOutput, token_ids: list) -> list:
        """Append each sampled sequence's new tokens (several for a drafted row) up to a stop."""
        assert len(out.sampled_seqs) == len(token_ids)
        drafts = getattr(out, "spec_token_ids", None) or [[]] * len(out.seqs)
        finished = []
        for i, (seq, tokens) in enumerate(zip(out.sampled_seqs, token_ids)):
            tokens = tokens if isinstance(tokens, list) else [tokens]
            drafted = i < out.num_decodes and bool(drafts[i])
            if drafted:
                self.spec_stats.observe(len(drafts[i]), len(tokens) - 1)
            for token_id in tokens:
                seq.append_token(token_id)
                reason = self.check_stop(seq, token_id)
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
            else:
                if drafted:  # KV is kept for every token but the newest: the accepted drafts' slots stay valid
                    seq.num_computed_tokens = seq.num_tokens - 1
                    self.cache_scheduled_blocks(seq)
        self.proposer.forget_except(self.running)
        return finished


def make_proposer(config):
    """The proposer config.spec_config names: propose(token_ids) for n-gram lookup; a draft model's
    batched propose is in draft_model.py."""
    c = config.spec_config
    if c.method == "draft_model":
        from minivllm.engine.draft_model import DraftModelProposer

        return DraftModelProposer(config)
    return NgramDrafts(NgramProposer(c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max))


@dataclass
class NgramDrafts:
    """The n-gram proposer behind the scheduler's batched interface (it keeps no state)."""

    ngram: NgramProposer

    def propose_batch(self, seqs, rooms: list[int]) -> list[list[int]]:
        return [self.ngram.propose(seq.token_ids)[:room] for seq, room in zip(seqs, rooms)]

    def forget_except(self, running) -> None:
        pass

    def shutdown(self) -> None:
        pass


class SpecAsyncScheduler(SpecDecodeScheduler, AsyncScheduler):
    """SpecDecodeScheduler with async scheduling's block bookkeeping (steps without drafts run ahead)."""


class SpecAsyncStepper(AsyncStepper):
    """AsyncStepper for speculative decoding: a step with drafts is collected before the next is
    scheduled (the next drafts read its tokens); steps without drafts, above the scheduler's
    disable_by_batch_size, run one ahead as without speculation."""

    def step(self) -> list:
        if self.inflight is not None:
            return super().step()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        handle = self.executor.launch(out)
        if out.has_drafts:
            return self.on_result(StepResult(out, self.executor.collect(handle), start))
        add_placeholders(out.sampled_seqs)
        self.inflight = InflightStep(out, handle, start)
        return []

    def _step_after_decode(self) -> list:
        if self.scheduler.drafts_at(len(self.scheduler.running)):  # the next step drafts: its tokens first
            return self.drain()
        return super()._step_after_decode()


class _WithDrafts:
    """A decode row seen with its drafts appended, for the core's prepare_prefill."""

    def __init__(self, seq, drafts: list[int]):
        self.token_ids = seq.token_ids + drafts
        self.num_computed_tokens = self.num_tokens = len(self.token_ids)
        self.block_table = seq.block_table


class _DecodeRow:
    """One position of a drafted decode row as a decode of its own, for prepare_decode: its token at
    `position`, attending to the keys at 0..position through the sequence's block table."""

    def __init__(self, seq, position: int, token_id: int):
        self.token_ids = [token_id]  # (prepare_decode reads only the last)
        self.last_token = token_id
        self.num_tokens = position + 1
        self.block_table = seq.block_table


def decode_rows(seqs, drafts: list[list[int]]) -> list[_DecodeRow]:
    """Each sequence's last token and its drafts, one decode row per position, in order."""
    return [_DecodeRow(seq, seq.num_tokens - 1 + j, token) for seq, d in zip(seqs, drafts)
            for j, token in enumerate([seq.last_token, *d])]


@dataclass
class VerifiedSample:
    """What `sample` gives for a step with drafts: each sampled sequence's new tokens."""

    token_ids: list[list[int]]
    prompt_logprobs: None = None  # (no prompt logprobs in a drafted step: SpecDecodeScheduler)

    def to_host(self, pin: bool = False) -> "VerifiedSample":
        return self  # (on the host already: the acceptance rule read the target's tokens)


@dataclass
class SpecOutput(ModelRunnerOutput):
    """sampled_token_ids: per sampled sequence, its 1..k+1 new tokens."""

    logprobs: None = None
    prompt_logprobs: None = None


class SpecDecodeRunner:
    """ModelRunner layer: a step with drafts is verified (hooks: prepare_inputs, sample, to_output)."""

    def max_decode_rows(self) -> int:
        """A decode step's rows with drafts: 1 + k per sequence, up to disable_by_batch_size of them."""
        c = self.config.spec_config
        drafting = min(self.config.max_num_seqs, c.disable_by_batch_size or self.config.max_num_seqs)
        rows = min(drafting * (1 + c.num_speculative_tokens), self.config.max_num_batched_tokens)
        return max(super().max_decode_rows(), rows)

    def prepare_inputs(self, out):
        if not getattr(out, "has_drafts", False):
            return super().prepare_inputs(out)
        if self.config.spec_config.verify == "decode" and out.num_decodes == len(out.seqs):
            return self.prepare_decode(decode_rows(out.seqs, out.spec_token_ids))
        views = [_WithDrafts(seq, drafts) if drafts else seq for seq, drafts in zip(out.seqs, out.spec_token_ids)]
        inputs = self.prepare_prefill(views, out.num_scheduled_tokens)
        ends = inputs.cu_seqlens_q[1:].astype(np.int64)
        # every position of a drafted row gives logits; a prompt chunk only its last, if it samples
        sampled = {id(seq) for seq in out.sampled_seqs}
        rows = [np.arange(end - len(drafts) - 1, end) if drafts else np.array([end - 1])
                for seq, drafts, end in zip(out.seqs, out.spec_token_ids, ends) if id(seq) in sampled]
        inputs.logits_indices = np.concatenate(rows).astype(np.int64)
        return inputs

    def sample(self, out, batch, logits: torch.Tensor):
        if not getattr(out, "has_drafts", False):
            return super().sample(out, batch, logits)
        drafts = [out.spec_token_ids[i] if i < out.num_decodes else [] for i in range(len(out.sampled_seqs))]
        starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])])
        tokens: list[list[int] | None] = [None] * len(drafts)
        plain = [j for j, d in enumerate(drafts) if not d]
        if plain:  # the sequences without drafts: the full sampler, on their rows alone
            rows = to_device(starts[plain], torch.int64, logits.device)
            sub_out = replace(out, sampled_seqs=[out.sampled_seqs[j] for j in plain])
            indices = batch.logits_indices  # (a decode step's: the slice of its rows)
            if isinstance(indices, slice):
                indices = torch.arange(indices.start, indices.stop, device=logits.device)
            sub_batch = replace(batch, logits_indices=indices[rows])
            for j, t in zip(plain, super().sample(sub_out, sub_batch, logits[rows]).token_ids.tolist()):
                tokens[j] = [t]
        drafted = [j for j, d in enumerate(drafts) if d]
        greedy = [j for j in drafted if out.sampled_seqs[j].sampling_params.is_greedy]
        if greedy:
            rows = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in greedy])
            argmax = logits[to_device(rows, torch.int64, logits.device)].argmax(dim=-1).tolist()
            for j in greedy:
                tokens[j] = accept_greedy(drafts[j], argmax[:len(drafts[j]) + 1])
                argmax = argmax[len(drafts[j]) + 1:]
        sampled = [j for j in drafted if j not in set(greedy)]
        if sampled:
            for j, t in zip(sampled, self._rejection_sample(out, logits, drafts, starts, sampled)):
                tokens[j] = t
        return VerifiedSample(tokens)

    def _rejection_sample(self, out, logits, drafts, starts, rows_of) -> list[list[int]]:
        """The rejection rule for the sampled (temperature > 0) drafted sequences `rows_of`."""
        k = max(len(drafts[j]) for j in rows_of)
        seqs = [out.sampled_seqs[j] for j in rows_of]
        rows = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in rows_of])
        per_row = [seq for seq, j in zip(seqs, rows_of) for _ in range(len(drafts[j]) + 1)]
        metadata = SamplingMetadata.from_sequences(per_row, logits.shape[-1], logits.device)
        scaled = logits[to_device(rows, torch.int64, logits.device)].float() / metadata.temperatures.unsqueeze(1)
        probs = _filter(scaled, metadata).softmax(dim=-1)  # [rows, vocab]: p exactly as the sampler draws
        padded = torch.zeros(len(seqs), k + 1, probs.shape[-1], device=probs.device)
        draft_ids = torch.zeros(len(seqs), k, dtype=torch.int64)
        row = 0
        for b, j in enumerate(rows_of):
            n = len(drafts[j])
            padded[b, :n + 1] = probs[row:row + n + 1]
            draft_ids[b, :n] = torch.tensor(drafts[j])
            row += n + 1
        num_drafts = to_device([len(drafts[j]) for j in rows_of], torch.int64, probs.device)
        return rejection_sample(padded, draft_ids.to(probs.device), num_drafts, generator=self.spec_generator()).to_lists()

    def spec_generator(self) -> torch.Generator:
        """The rejection rule's random stream: this engine's own, on the logits' device."""
        if self.device.type == "cpu":
            return self.generator
        if getattr(self, "_spec_generator", None) is None:
            self._spec_generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        return self._spec_generator

    def to_output(self, sampled):
        if isinstance(sampled, VerifiedSample):
            return SpecOutput(sampled.token_ids)
        return super().to_output(sampled)


def accept_greedy(drafts: list[int], target_ids: list[int]) -> list[int]:
    """Greedy verification: drafts kept while they equal the target's argmax, then the target's
    own token at the first difference (or after the last draft: the bonus token)."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return drafts[:num_accepted] + [target_ids[num_accepted]]
