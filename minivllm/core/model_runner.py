"""The ModelRunner: owns the model and the paged KV cache, turns a scheduled step into tensors, runs
the forward pass and samples the next tokens.

    execute_model(out: SchedulerOutput):
        inputs = prepare_inputs(out)          host arrays: token ids, positions, slots, block tables
        batch  = upload(inputs)               device tensors + the step's AttentionMetadata
        hidden = forward(batch)               the model, attention reading the metadata
        logits = compute_logits(batch, hidden)   the LM head over each sampled sequence's last token
        return sample(out, batch, logits)     one token id per sampled sequence

Each step above is a method that the engine's layers extend in subclasses (minivllm/engine/:
CUDA graphs replay `forward`, the sampler layer replaces `sample`, ...); this file is the plain path.
vLLM: vllm/v1/worker/gpu_model_runner.py; nano-vllm: nanovllm/engine/model_runner.py.
"""
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.config import Config
from minivllm.core.attention import Attention, AttentionMetadata, get_attention_backend, set_forward_context
from minivllm.core.device import to_device
from minivllm.core.sampler import Sampler, SamplingMetadata, check_core_features
from minivllm.core.scheduler import SchedulerOutput
from minivllm.core.sequence import Sequence
from minivllm.models.loader import get_model
from minivllm.models.transformer import head_dim_of

logger = logging.getLogger("minivllm")


@dataclass
class StepInputs:
    """One step's inputs on the host (numpy), packed back to back (see AttentionMetadata):

        input_ids, positions, slot_mapping:   [num_tokens]   (slot -1: store nothing)
        logits_indices:                       [num_sampled] row of each sampled sequence's last token
        block_tables:                         [num_seqs, max_num_blocks_per_seq], zero-padded
        prefill: cu_seqlens_q, cu_seqlens_k   [num_seqs + 1] new tokens / all tokens, cumulative
        decode:  context_lens, seq_order      [num_seqs] keys in the cache; longest first
    """

    input_ids: np.ndarray  # int64
    positions: np.ndarray  # int64
    slot_mapping: np.ndarray  # int32
    logits_indices: np.ndarray  # int64
    block_tables: np.ndarray  # int32
    is_prefill: bool  # prompt tokens in the step; False: one new token per sequence (decode)
    cu_seqlens_q: np.ndarray | None = None  # int32 (prefill)
    cu_seqlens_k: np.ndarray | None = None  # int32 (prefill)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    has_prefix: bool = False  # (prefill) some sequence continues a prefix that is in the cache
    context_lens: np.ndarray | None = None  # int32 (decode)
    seq_order: np.ndarray | None = None  # int32 (decode)
    num_decodes: int = 0  # a mixed step's first sequences are decode rows (one new token each)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ModelRunnerOutput:
    """What a step gives back to the engine (the layers add to it: logprobs, ...)."""

    sampled_token_ids: list[int]  # one per sequence of the step's sampled_seqs


@dataclass
class Batch:
    """A step's inputs on the device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor | slice  # [num_sampled] int64 (decode: the slice of rows 0 .. n-1)
    attn: AttentionMetadata
    inputs: StepInputs  # the host inputs it was uploaded from


class ModelRunner:
    """One device's model shard and KV cache.

    Args:
        config: the engine's config (num_kvcache_blocks None: sized by `num_kv_blocks`).
        device: where the model runs (default: config.device).
        rank: which shard of the model this runner holds (tensor parallelism; 0 on one device).
    """

    step_inputs_class = StepInputs  # what prepare_inputs makes (a layer may extend it)

    def __init__(self, config: Config, device: torch.device | None = None, rank: int = 0):
        self.config, self.rank = config, rank
        self.device = device or torch.device(config.device)
        self.block_size = config.kvcache_block_size
        # a sequence at max_model_len plus the token being decoded must fit its block table
        self.max_num_blocks_per_seq = -(-(config.max_model_len + 1) // self.block_size)
        # The noise of unseeded samples: this engine's own generator, so that two engines (or the
        # application) never draw from one another's stream.
        self.generator = torch.Generator().manual_seed(config.seed)
        start = time.perf_counter()
        self.model = self.load_model()
        logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - start)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_attention_backend(config.attention_backend)
        for layer in self.attention_layers:
            layer.backend = backend
        self.sampler = self.make_sampler()
        start = time.perf_counter()
        self.num_kvcache_blocks = config.num_kvcache_blocks or self.num_kv_blocks()
        self.allocate_kv_cache(self.num_kvcache_blocks)
        logger.info("KV cache sized and allocated in %.1f s", time.perf_counter() - start)

    # ---- building ---------------------------------------------------------------------------------
    def load_model(self) -> torch.nn.Module:
        return get_model(self.config, self.device, self.rank)

    def make_sampler(self) -> Sampler:
        return Sampler(self.generator)

    def max_decode_rows(self) -> int:
        """The most rows a decode step has: one per running sequence (a layer may ask for more)."""
        return self.config.max_num_seqs

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, block_size tokens, this rank's KV heads."""
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.cache_dtype.itemsize

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    def num_kv_blocks(self) -> int:
        """cpu_kvcache_space_bytes of blocks, but no more than max_num_seqs sequences of max_model_len
        tokens can fill (an engine made for a few short sequences takes what they can use)."""
        cfg = self.config
        enough = cfg.max_num_seqs * self.max_num_blocks_per_seq
        return min(cfg.cpu_kvcache_space_bytes // self.kv_cache_block_bytes(), enough)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor for every layer's K and V; each Attention layer gets its views."""
        cfg, layer = self.config, self.attention_layers[0]
        needed = -(-cfg.max_model_len // self.block_size)  # blocks for one sequence of max_model_len tokens
        if num_blocks < needed:
            raise ValueError(f"the KV cache fits {num_blocks} blocks of {self.block_size} tokens "
                             f"({self.kv_cache_block_bytes() / 2**20:.2f} MiB each), but one sequence of "
                             f"max_model_len={cfg.max_model_len} needs {needed}; lower max_model_len or raise "
                             f"the cache's size ({self.kv_cache_size_hint()})")
        # [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads (this rank's), head_dim]
        self.kv_cache = torch.empty(2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    head_dim_of(cfg.hf_config), dtype=self.cache_dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB), max concurrency %.1f sequences of %d tokens",
                    num_blocks, self.block_size, self.cache_dtype, self.kv_cache.numel() *
                    self.kv_cache.element_size() / 2**30, num_blocks / needed, cfg.max_model_len)

    def kv_cache_size_hint(self) -> str:
        return "num_kvcache_blocks / cpu_kvcache_space_bytes"

    def shutdown(self) -> None:
        """Give back the KV cache and the model's weights. Idempotent."""
        if self.model is None:
            return
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.model = self.attention_layers = None

    # ---- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step: a token id for each sequence of out.sampled_seqs."""
        batch = self.upload(self.prepare_inputs(out))
        logits = self.compute_logits(batch, self.forward(batch))
        return self.to_output(self.sample(out, batch, logits))

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        if out.is_prefill:
            return self.prepare_prefill(out.seqs, out.num_scheduled_tokens, out.num_decodes)
        return self.prepare_decode(out.seqs)

    def prepare_prefill(self, seqs: list[Sequence], num_scheduled_tokens: list[int], num_decodes: int = 0,
                        use_cache: bool = True) -> StepInputs:
        """Pack the step's tokens back to back. A sequence's scheduled tokens end at
        seq.num_computed_tokens (the scheduler counted them already); the first `num_decodes`
        sequences are decode rows (one token each, their context in the cache). use_cache=False:
        a forward that stores nothing (warm-ups)."""
        ends = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        starts = ends - np.array(num_scheduled_tokens, dtype=np.int64)
        input_ids = np.concatenate([seq.token_ids[a:b] for seq, a, b in zip(seqs, starts, ends)]).astype(np.int64)
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
        slots = [self._slots(seq, a, b) if use_cache else np.full(b - a, -1) for seq, a, b in zip(seqs, starts, ends)]
        cu_seqlens_q = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32)
        return StepInputs(input_ids, positions, np.concatenate(slots).astype(np.int32),
                          self._logits_indices(seqs, cu_seqlens_q), self._block_tables(seqs), True, cu_seqlens_q,
                          np.concatenate([[0], np.cumsum(ends)]).astype(np.int32), int((ends - starts).max()),
                          int(ends.max()), bool((starts > 0).any()), num_decodes=num_decodes)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        """One new token per sequence: its last, at position num_tokens - 1."""
        lens = np.array([seq.num_tokens for seq in seqs], dtype=np.int32)
        bs = self.block_size
        slots = [seq.block_table[(n - 1) // bs] * bs + (n - 1) % bs for seq, n in zip(seqs, lens.tolist())]
        return StepInputs(np.array([seq.last_token for seq in seqs], dtype=np.int64), (lens - 1).astype(np.int64),
                          np.array(slots, dtype=np.int32), np.arange(len(seqs), dtype=np.int64),
                          self._block_tables(seqs), False, context_lens=lens,
                          seq_order=np.argsort(-lens, kind="stable").astype(np.int32), num_decodes=len(seqs))

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Cache slot of each token position in [start, end): block id * block_size + offset."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1  # the blocks that hold [start, end)
        slots = np.asarray(seq.block_table[first:last], dtype=np.int64)[:, None] * bs + np.arange(bs)
        return slots.ravel()[start - first * bs:end - first * bs]

    def _block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """[len(seqs), max_num_blocks_per_seq] int32, zero-padded. One width for every step: a Triton
        kernel is compiled per (value class of) its integer arguments, the row stride among them."""
        tables = np.zeros((len(seqs), self.max_num_blocks_per_seq), dtype=np.int32)
        for row, seq in zip(tables, seqs):
            row[:len(seq.block_table)] = seq.block_table
        return tables

    @staticmethod
    def _logits_indices(seqs: list[Sequence], cu_seqlens_q: np.ndarray) -> np.ndarray:
        """Row of the last token of each sequence whose step reaches its end (it samples)."""
        sampled = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens == seq.num_tokens]
        return cu_seqlens_q[1:][sampled].astype(np.int64) - 1

    def upload(self, inputs: StepInputs) -> Batch:
        """The step's inputs on the device."""
        return self.make_batch(inputs, lambda name: to_device(getattr(inputs, name), None, self.device))

    @staticmethod
    def make_batch(inputs: StepInputs, on_device) -> Batch:
        """The Batch of `inputs`, on_device(name) giving each array's device tensor, with the step's
        attention metadata (built here and only here)."""
        if not inputs.is_prefill:  # every sequence samples: rows 0 .. n-1, a slice (no gather)
            attn = AttentionMetadata(False, on_device("slot_mapping"), block_tables=on_device("block_tables"),
                                     context_lens=on_device("context_lens"), seq_order=on_device("seq_order"))
            return Batch(on_device("input_ids"), on_device("positions"), slice(0, len(inputs.logits_indices)),
                         attn, inputs)
        attn = AttentionMetadata(True, on_device("slot_mapping"), on_device("cu_seqlens_q"), on_device("cu_seqlens_k"),
                                 inputs.max_seqlen_q, inputs.max_seqlen_k,
                                 on_device("block_tables") if inputs.has_prefix else None)
        return Batch(on_device("input_ids"), on_device("positions"), on_device("logits_indices"), attn, inputs)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step's tokens."""
        with set_forward_context(batch.attn):
            return self.model(batch.input_ids, batch.positions)

    def compute_logits(self, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_sampled, vocab] of each sampled sequence's last token."""
        return self.model.compute_logits(hidden[batch.logits_indices])

    def sample(self, out: SchedulerOutput, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        """[num_sampled] int64 token ids, on the device."""
        check_core_features([seq.sampling_params for seq in out.sampled_seqs])
        metadata = SamplingMetadata.from_sequences(out.sampled_seqs, logits.shape[-1], logits.device,
                                                   self.config.eos_token_id)
        return self.sampler(logits, metadata)

    def to_output(self, sampled: torch.Tensor) -> ModelRunnerOutput:
        """What `sample` gave, on the host (the device syncs here)."""
        return ModelRunnerOutput(sampled.tolist())
