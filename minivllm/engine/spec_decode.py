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

Penalties, per-request seeds and logprobs keep their meaning with drafts: position i of a drafted
row is processed as if d1..di had been emitted (the penalties count them; a seeded request draws
from its own stream of that step, so it reproduces whatever shares its batch), and each emitted
token's raw logprobs come from the logits of its own position. A sequence below min_tokens decodes
without drafts; so does every sequence when more than `disable_by_batch_size` run (drafts stop
paying at large batches).
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
from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID, AsyncStepper, InflightStep
from minivllm.engine.async_scheduling import add_placeholders
from minivllm.engine.logprobs import compute_logprobs, gather_logprobs
from minivllm.engine.ngram_proposer import NgramProposer
from minivllm.engine.rejection_sampler import rejection_sample
from minivllm.engine.sampler import PenaltyTensors, _filter, apply_penalties, seeded_generator

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
    propose_ms: float = 0.0  # host time the proposer took for this step (a draft model's forwards included)

    @property
    def has_drafts(self) -> bool:
        return any(self.spec_token_ids)


class SpecDecodeScheduler(Scheduler):
    """The core scheduler plus drafts for the decode rows (see the module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self.spec_config = config.spec_config
        self.proposer = make_proposer(config)
        self.spec_stats = SpecDecodingStats(self.spec_config.num_speculative_tokens)

    def schedule(self) -> SpecSchedulerOutput:
        out = super().schedule()
        drafts, propose_ms = [[] for _ in out.seqs], 0.0
        if self._step_may_draft(out):
            budget = self.max_num_batched_tokens - out.num_batched_tokens
            rows, rooms = [], []
            for i, seq in enumerate(out.seqs[:out.num_decodes]):
                room = min(budget, self._room(seq))
                if room > 0:
                    rows.append(i)
                    rooms.append(room)
                    budget -= room
            start = time.perf_counter()
            proposals = self.proposer.propose_batch([out.seqs[i] for i in rows], rooms) if rows else []
            propose_ms = (time.perf_counter() - start) * 1e3
            for i, proposal in zip(rows, proposals):  # (no blocks left for a proposal: a plain decode)
                if proposal and self.kv_cache_manager.allocate_slots(out.seqs[i], len(proposal)):
                    drafts[i] = proposal
        num_tokens = [n + len(d) for n, d in zip(out.num_scheduled_tokens, drafts)]
        return SpecSchedulerOutput(out.seqs, num_tokens, out.num_decodes, out.sampled_seqs, out.num_cached_tokens,
                                   drafts, propose_ms)

    def finish(self, seq, reason: str) -> None:
        """As the core's, and the proposer forgets seq (a stop string or an abort ends a sequence
        outside update_from_output: the draft's blocks come back now, not at the next step)."""
        super().finish(seq, reason)
        self.proposer.forget(seq.seq_id)

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
        if seq.num_completion_tokens < params.min_tokens:  # (EOS is banned until then: plain decodes)
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

    def forget(self, seq_id) -> None:
        pass

    def shutdown(self) -> None:
        pass


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


class _DraftedPosition:
    """Position i of a drafted row seen as its sequence with d1..di emitted: the tokens the penalties
    count there, and the step a seeded request's stream is at."""

    def __init__(self, seq, drafts: list[int]):
        self.sampling_params = seq.sampling_params
        self.token_ids = seq.token_ids + drafts
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_completion_tokens = self.num_tokens - self.num_prompt_tokens
        self.last_token = self.token_ids[-1]


@dataclass
class VerifiedSample:
    """What `sample` gives for a step with drafts: each sampled sequence's new tokens, and, when a
    request of the step asks for logprobs, each sequence's (ids, logprobs, rank) per new token."""

    token_ids: list[list[int]]
    logprobs: list[list[tuple] | None] | None = None
    prompt_logprobs: None = None  # (no prompt logprobs in a drafted step: SpecDecodeScheduler)

    def to_host(self, pin: bool = False) -> "VerifiedSample":
        return self  # (on the host already: the acceptance rule read the target's tokens)


@dataclass
class SpecOutput(ModelRunnerOutput):
    """sampled_token_ids: per sampled sequence, its 1..k+1 new tokens; logprobs: per sampled
    sequence, one (ids, logprobs, rank) per new token (None: not asked)."""

    logprobs: list[list[tuple] | None] | None = None
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
        """logits: [rows, vocab], 1 + len(drafts) consecutive rows per sampled sequence."""
        if not getattr(out, "has_drafts", False):
            return super().sample(out, batch, logits)
        drafts = [out.spec_token_ids[i] if i < out.num_decodes else [] for i in range(len(out.sampled_seqs))]
        starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])])
        tokens: list[list[int] | None] = [None] * len(drafts)
        asks = any(seq.sampling_params.logprobs is not None for seq in out.sampled_seqs)
        logprobs = [None] * len(drafts) if asks else None
        plain = [j for j, d in enumerate(drafts) if not d]
        if plain:  # the sequences without drafts: the full sampler, on their rows alone
            rows = to_device(starts[plain], torch.int64, logits.device)
            sub_out = replace(out, sampled_seqs=[out.sampled_seqs[j] for j in plain])
            indices = batch.logits_indices  # (a decode step's: the slice of its rows)
            if isinstance(indices, slice):
                indices = torch.arange(indices.start, indices.stop, device=logits.device)
            sampled = super().sample(sub_out, replace(batch, logits_indices=indices[rows]), logits[rows])
            entries = list(zip(*sampled.logprobs.tolists())) if sampled.logprobs is not None else None
            for n, (j, t) in enumerate(zip(plain, sampled.token_ids.tolist())):
                tokens[j] = [t]
                if entries is not None:
                    logprobs[j] = [entries[n]]
        drafted = [j for j, d in enumerate(drafts) if d]
        if drafted:
            rows = to_device(np.concatenate([np.arange(starts[j], starts[j + 1]) for j in drafted]), torch.int64,
                             logits.device)
            verified = self._verify([out.sampled_seqs[j] for j in drafted], [drafts[j] for j in drafted], logits[rows])
            for j, t in zip(drafted, verified):
                tokens[j] = t
            if asks:
                self._emitted_logprobs(out.sampled_seqs, logits, starts, drafted, tokens, logprobs)
        return VerifiedSample(tokens, logprobs)

    def _verify(self, seqs, drafts: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
        """Each drafted sequence's new tokens. logits: [rows, vocab], 1 + len(drafts[b]) rows for
        sequence b; position i is processed as if d1..di had been emitted."""
        views = [_DraftedPosition(seq, d[:i]) for seq, d in zip(seqs, drafts) for i in range(len(d) + 1)]
        if any(seq.sampling_params.uses_penalties for seq in seqs):
            logits = apply_penalties(logits, PenaltyTensors.from_sequences(views, logits.shape[-1], logits.device))
        offsets = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])])
        tokens: list[list[int] | None] = [None] * len(seqs)
        greedy = [b for b, seq in enumerate(seqs) if seq.sampling_params.is_greedy]
        if greedy:
            argmax = logits.argmax(dim=-1).tolist()
            for b in greedy:
                tokens[b] = accept_greedy(drafts[b], argmax[offsets[b]:offsets[b + 1]])
        sampled = [b for b, seq in enumerate(seqs) if not seq.sampling_params.is_greedy]
        if sampled:
            rows = np.concatenate([np.arange(offsets[b], offsets[b + 1]) for b in sampled])
            accepted = self._rejection_sample([seqs[b] for b in sampled], [drafts[b] for b in sampled],
                                              [views[r] for r in rows], logits[to_device(rows, torch.int64, logits.device)])
            for b, t in zip(sampled, accepted):
                tokens[b] = t
        return tokens

    def _rejection_sample(self, seqs, drafts, views, logits) -> list[list[int]]:
        """The rejection rule for sampled (temperature > 0) drafted sequences. A seeded request
        draws from its own stream of this step (seeded_generator), the others from the engine's."""
        metadata = SamplingMetadata.from_sequences(views, logits.shape[-1], logits.device)
        scaled = logits.float() / metadata.temperatures.unsqueeze(1)
        probs = _filter(scaled, metadata).softmax(dim=-1)  # [rows, vocab]: p exactly as the sampler draws
        k = max(len(d) for d in drafts)
        padded = torch.zeros(len(seqs), k + 1, probs.shape[-1], device=probs.device)  # [batch, k + 1, vocab]
        draft_ids = torch.zeros(len(seqs), k, dtype=torch.int64)
        row = 0
        for b, d in enumerate(drafts):
            padded[b, :len(d) + 1] = probs[row:row + len(d) + 1]
            draft_ids[b, :len(d)] = torch.tensor(d)
            row += len(d) + 1
        draft_ids = draft_ids.to(probs.device)
        num_drafts = to_device([len(d) for d in drafts], torch.int64, probs.device)
        tokens: list[list[int] | None] = [None] * len(seqs)
        unseeded = [b for b, seq in enumerate(seqs) if seq.sampling_params.seed is None]
        if unseeded:
            at = to_device(unseeded, torch.int64, probs.device)
            out = rejection_sample(padded[at], draft_ids[at], num_drafts[at], generator=self.spec_generator())
            for b, t in zip(unseeded, out.to_lists()):
                tokens[b] = t
        for b, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:  # (its own stream: the same tokens whatever its batch)
                generator = seeded_generator(seq.sampling_params.seed, seq.num_completion_tokens, probs.device)
                tokens[b] = rejection_sample(padded[b:b + 1], draft_ids[b:b + 1], num_drafts[b:b + 1],
                                             generator=generator).to_lists()[0]
        return tokens

    @staticmethod
    def _emitted_logprobs(seqs, logits, starts, drafted, tokens, logprobs) -> None:
        """Raw logprobs of each emitted token of the drafted sequences that ask, from its own position."""
        asking = [j for j in drafted if seqs[j].sampling_params.logprobs is not None]
        if not asking:
            return
        rows = np.concatenate([starts[j] + np.arange(len(tokens[j])) for j in asking])
        token_ids = to_device([t for j in asking for t in tokens[j]], torch.int64, logits.device)
        num_logprobs = max(seqs[j].sampling_params.logprobs for j in asking)
        raw = compute_logprobs(logits[to_device(rows, torch.int64, logits.device)])  # before any processing
        entries = list(zip(*gather_logprobs(raw, token_ids, num_logprobs).tolists()))
        for j in asking:
            logprobs[j], entries = entries[:len(tokens[j])], entries[len(tokens[j]):]

    def spec_generator(self) -> torch.Generator:
        """The rejection rule's random stream: this engine's own, on the logits' device."""
        if self.device.type == "cpu":
            return self.generator
        if getattr(self, "_spec_generator", None) is None:
            self._spec_generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        return self._spec_generator

    def to_output(self, sampled):
        if isinstance(sampled, VerifiedSample):
            return SpecOutput(sampled.token_ids, logprobs=sampled.logprobs)
        return super().to_output(sampled)


def accept_greedy(drafts: list[int], target_ids: list[int]) -> list[int]:
    """Greedy verification: drafts kept while they equal the target's argmax, then the target's
    own token at the first difference (or after the last draft: the bonus token)."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return drafts[:num_accepted] + [target_ids[num_accepted]]
