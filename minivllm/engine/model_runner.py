"""The ModelRunner: owns the model and the paged KV cache, turns scheduled sequences into tensors,
runs the forward pass and samples the next tokens.

    scheduled seqs --prepare_prefill/prepare_decode--> input_ids, positions, AttentionMetadata
                   --model--> hidden states --last token of each seq--> logits --Sampler--> token ids

vLLM: vllm/v1/worker/gpu_model_runner.py; nano-vllm: nanovllm/engine/model_runner.py.
"""
import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.config import Config
from minivllm.engine.sequence import Sequence
from minivllm.kernels.quant_fp8 import is_fp8
from minivllm.layers.attention import Attention
from minivllm.engine.cuda_graph import CUDAGraphRunner, DecodeBuffers, graph_batch_size_for
from minivllm.layers.sampler import Sampler, SamplingTensors
from minivllm.models.transformer import head_dim_of
from minivllm.utils.compile import set_compile_enabled
from minivllm.utils.context import AttentionMetadata, set_forward_context
from minivllm.utils.loader import build_model

logger = logging.getLogger("minivllm")


class ModelRunner:
    def __init__(self, config: Config):
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        if self.device.type == "cuda":
            # What the device holds before this engine takes anything: the KV sizing tells this
            # engine's own memory apart from other engines' and processes'.
            gc.collect()  # an engine dropped without shutdown() (a re-run notebook cell) lets go now
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.free_bytes_at_start = torch.cuda.mem_get_info(self.device)[0]
        torch.manual_seed(config.seed)
        set_compile_enabled(config.compile_small_ops)
        start = time.perf_counter()
        self.model = build_model(config.model, config.hf_config, config.torch_dtype, self.device,
                                 config.attention_backend)
        logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - start)
        self.sampler = Sampler()
        self.memory_report: str | None = None  # how device memory was shared out (CUDA, sized from memory)
        # a sequence at max_model_len plus the token being decoded must fit its block table
        self.max_num_blocks_per_seq = -(-(config.max_model_len + 1) // self.block_size)
        self.allocate_kv_cache()
        if self.device.type == "cuda":
            self._warmup_prefill_variants()
        self.decode_buffers = DecodeBuffers(config.max_num_seqs, self.max_num_blocks_per_seq, self.device)
        self.graphs = None
        if self._use_cuda_graphs():
            self.graphs = CUDAGraphRunner(self.model, self.decode_buffers, config.max_num_seqs)
            self.graphs.capture()
        if self.kv_scales is not None and config.calculate_kv_scales:  # after the warm-ups: real prompts only
            for layer in self.attention_layers:
                layer.calculate_kv_scales = True

    def _use_cuda_graphs(self) -> bool:
        cfg = self.config
        if cfg.enforce_eager or self.device.type != "cuda":
            return False
        if cfg.attention_backend != "triton":
            logger.info("CUDA graphs off: the %r attention backend syncs with the host", cfg.attention_backend)
            return False
        return True

    # ---- KV cache ---------------------------------------------------------------------------------
    def kv_cache_block_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, block_size tokens, every KV head."""
        hf = self.config.hf_config
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_of(hf)
        return per_token * self.block_size * self.config.kv_cache_torch_dtype.itemsize  # FP8: 1 byte

    def _num_blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            return self.config.cpu_kvcache_space_bytes // self.kv_cache_block_bytes()
        return self._profile_gpu_blocks()

    def _profile_gpu_blocks(self) -> int:
        """vLLM's sizing: this engine may use gpu_memory_utilization x total device memory. Run the
        largest prefill the config allows, measure this engine's weights and peak activations, and
        give the rest of that budget to KV blocks (never more than is free now).

            total:  |== other processes / engines ==|== this engine: weights | activations | KV ... ==| free |
                                                     <-- gpu_memory_utilization x total -->
        """
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup_prefill()
        stats = torch.cuda.memory_stats(self.device)
        peak_activation = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization
        engine_bytes = self.free_bytes_at_start - free + peak_activation  # weights, workspaces, activations
        others_bytes = total - self.free_bytes_at_start
        available = min(budget - engine_bytes, free - peak_activation)
        gib = 2**30
        logger.info("GPU memory: total %.1f GiB, budget %.1f GiB (gpu_memory_utilization=%.2f), this engine's "
                    "weights and activations %.2f GiB, held by others %.1f GiB, for KV %.1f GiB",
                    total / gib, budget / gib, self.config.gpu_memory_utilization, engine_bytes / gib,
                    others_bytes / gib, max(available, 0) / gib)
        self.memory_report = (f"gpu_memory_utilization={self.config.gpu_memory_utilization} x {total / gib:.1f} GiB "
                              f"= {budget / gib:.1f} GiB for this engine; its weights and activations take "
                              f"{engine_bytes / gib:.2f} GiB; other processes or engines hold {others_bytes / gib:.1f} GiB "
                              f"and {free / gib:.1f} GiB is free")
        return max(0, int(available // self.kv_cache_block_bytes()))

    def _warmup_prefill(self):
        """One forward over max_num_batched_tokens tokens in max_model_len-long sequences (no cache yet)."""
        cfg = self.config
        num_seqs = max(1, min(cfg.max_num_batched_tokens // cfg.max_model_len, cfg.max_num_seqs))
        seqs = [Sequence([0] * cfg.max_model_len, block_size=self.block_size) for _ in range(num_seqs)]
        input_ids, positions, meta = self.prepare_prefill(seqs, use_cache=False)
        with torch.inference_mode(), set_forward_context(meta):
            hidden = self.model(input_ids, positions)
            self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
        torch.cuda.synchronize(self.device)
        del hidden

    @torch.inference_mode()
    def _warmup_prefill_variants(self):
        """Compile the prefill kernels' variants now rather than inside the first requests: the
        attention tiles depend on the longest prompt of a step, and a prefix-cache hit reads keys
        through the paged cache (a separate compiled kernel). Nothing is written to the cache."""
        start, bs = time.perf_counter(), self.block_size
        for n in sorted({8, min(512, self.config.max_model_len), self.config.max_model_len}):
            for cached in (0, bs):  # a plain prefill; one with a cached first block
                if cached >= n:
                    continue
                ids = torch.zeros(n - cached, dtype=torch.int64, device=self.device)
                positions = torch.arange(cached, n, device=self.device)
                meta = AttentionMetadata(
                    is_prefill=True, slot_mapping=torch.full((n - cached,), -1, dtype=torch.int32, device=self.device),
                    cu_seqlens_q=self._tensor([0, n - cached]), cu_seqlens_k=self._tensor([0, n]),
                    max_seqlen_q=n - cached, max_seqlen_k=n,
                    block_tables=torch.zeros((1, -(-n // bs)), dtype=torch.int32, device=self.device) if cached else None)
                with set_forward_context(meta):
                    self.model(ids, positions)
        torch.cuda.synchronize(self.device)
        logger.info("prefill kernels warmed up in %.1f s", time.perf_counter() - start)

    def allocate_kv_cache(self):
        cfg, hf = self.config, self.config.hf_config
        num_blocks = cfg.num_kvcache_blocks or self._num_blocks_from_memory()
        needed = -(-cfg.max_model_len // self.block_size)  # blocks for one sequence of max_model_len tokens
        if num_blocks < needed:
            memory = f" ({self.memory_report})" if self.memory_report else ""
            raise ValueError(
                f"the KV cache fits {num_blocks} blocks of {self.block_size} tokens "
                f"({self.kv_cache_block_bytes() / 2**20:.2f} MiB each){memory}, but one sequence of max_model_len="
                f"{cfg.max_model_len} needs {needed}; lower max_model_len, raise gpu_memory_utilization / "
                f"num_kvcache_blocks, or shut down other engines (LLM.shutdown())")
        cfg.num_kvcache_blocks = num_blocks
        self.attention_layers = attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.empty(2, len(attention_layers), num_blocks, self.block_size,
                                    attention_layers[0].num_kv_heads, head_dim_of(hf),
                                    dtype=cfg.kv_cache_torch_dtype, device=self.device)
        # FP8: one K and one V scale per layer, 1.0 as in vLLM until calculate_kv_scales sets them
        self.kv_scales = None  # [2 (K, V), num_layers, 1] float32
        if is_fp8(cfg.kv_cache_torch_dtype):
            self.kv_scales = torch.ones(2, len(attention_layers), 1, dtype=torch.float32, device=self.device)
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if self.kv_scales is not None:
                layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB), max concurrency %.1f sequences of %d tokens",
                    num_blocks, self.block_size, cfg.kv_cache_torch_dtype,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
                    num_blocks / needed, cfg.max_model_len)

    def shutdown(self):
        """Give back everything this runner holds on the device: the KV cache, the CUDA graphs and
        their memory pool, the static decode buffers and the model's weights. Idempotent."""
        if self.model is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for layer in self.model.modules():
            if isinstance(layer, Attention):
                layer.k_cache = layer.v_cache = torch.tensor([])
                layer.k_scale = layer.v_scale = None
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = self.decode_buffers = self.kv_cache = self.kv_scales = self.model = None
        self.attention_layers = []
        gc.collect()  # the model's modules reference each other (cycles)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- step inputs ------------------------------------------------------------------------------
    def _tensor(self, values, dtype=torch.int32):
        """A host list or numpy array on the device, through pinned memory (no sync on CUDA)."""
        host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Cache slot of each token position in [start, end): block id * block_size + offset."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs + 1  # the blocks that hold [start, end)
        slots = np.asarray(seq.block_table[first:last], dtype=np.int64)[:, None] * bs + np.arange(bs)
        return slots.ravel()[start - first * bs:end - first * bs]

    def prepare_prefill(self, seqs: list[Sequence], use_cache: bool = True):
        """Pack the uncached tokens of every sequence back to back (see AttentionMetadata)."""
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids += seq.token_ids[start:]
            positions.append(np.arange(start, seq.num_tokens))
            cu_seqlens_q.append(cu_seqlens_q[-1] + seq.num_tokens - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seq.num_tokens)
            slot_mapping.append(self._slots(seq, start, seq.num_tokens) if use_cache
                                else np.full(seq.num_tokens - start, -1))
        block_tables = None
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:  # some prefix was cached: keys come from the paged cache
            width = max(len(seq.block_table) for seq in seqs)
            block_tables = self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs])
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=self._tensor(np.concatenate(slot_mapping).astype(np.int32)),
            cu_seqlens_q=self._tensor(cu_seqlens_q), cu_seqlens_k=self._tensor(cu_seqlens_k),
            max_seqlen_q=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_seqlen_k=max(seq.num_tokens for seq in seqs), block_tables=block_tables,
        )
        return self._tensor(input_ids, torch.int64), self._tensor(np.concatenate(positions), torch.int64), meta

    def prepare_decode(self, seqs: list[Sequence], padded_batch: int | None = None):
        """One new token per sequence (the last one, at position num_tokens - 1), staged in the
        pinned host buffer and copied to the static device buffers in one transfer."""
        buf = self.decode_buffers
        n, padded_batch = len(seqs), padded_batch or len(seqs)
        buf.next_host_buffer()
        host = buf.host_views
        bs = self.block_size
        lens = [seq.num_tokens for seq in seqs]
        host.input_ids[:n] = [seq.token_ids[-1] for seq in seqs]
        host.context_lens[:n] = lens
        host.positions[:n] = host.context_lens[:n] - 1
        host.slot_mapping[:n] = [seq.block_table[(m - 1) // bs] * bs + (m - 1) % bs for seq, m in zip(seqs, lens)]
        buf.write_block_tables([seq.block_table for seq in seqs])
        host.input_ids[n:padded_batch] = 0  # padding rows (CUDA graphs): a valid token id,
        host.slot_mapping[n:padded_batch] = -1  # write nothing,
        host.context_lens[n:padded_batch] = 0  # attend to nothing
        # attention visits the longest contexts first (a shorter kernel tail); padding rows go last
        host.seq_order[:padded_batch] = np.argsort(-host.context_lens[:padded_batch], kind="stable")
        buf.upload()
        return buf.views(padded_batch)

    # ---- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def compute_logits(self, seqs: list[Sequence], is_prefill: bool,
                       input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last token of each sequence: [num_seqs, vocab], in the model's dtype (the
        sampler reads them as they are; a float32 copy would be another pass over the vocabulary).

        input_ids (decode only): the step's input tokens already on the device (the previous step's
        samples, under async scheduling) instead of each sequence's last token id.
        """
        if is_prefill:
            ids, positions, meta = self.prepare_prefill(seqs)
            with set_forward_context(meta):
                hidden = self.model(ids, positions)
            return self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
        n = len(seqs)
        use_graph = self.graphs is not None and n <= self.graphs.max_batch_size
        # Eager decode pads like the graphs do, so both run the same kernels on the same shapes and
        # give bit-identical results (and CPU tests exercise the padding rows too).
        padded = graph_batch_size_for(n, self.config.max_num_seqs)
        ids, positions, meta = self.prepare_decode(seqs, padded)
        if input_ids is not None:
            ids[:n].copy_(input_ids, non_blocking=True)
        if use_graph:
            hidden = self.graphs.replay(padded)
        else:
            with set_forward_context(meta):
                hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden[:n])

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, input_ids: torch.Tensor | None = None) -> "StepHandle":
        """Queue one step's forward and sampling on the device; the sampled ids arrive later
        (`collect`). Nothing here waits for the device."""
        logits = self.compute_logits(seqs, is_prefill, input_ids)
        tensors = SamplingTensors.from_sequences(seqs, logits.shape[-1], logits.device, self.config.eos_token_id)
        token_ids = self.sampler.sample(logits, tensors)  # [num_seqs] int64, on the device
        return StepHandle.start_copy(token_ids, self.device)

    def collect(self, handle: "StepHandle") -> list[int]:
        return handle.wait()

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        return self.collect(self.launch(seqs, is_prefill))


@dataclass
class StepHandle:
    """Sampled token ids on their way to the host: a non-blocking copy into pinned memory plus an
    event, so the host can schedule the next step while the device still computes this one."""

    token_ids: torch.Tensor  # [num_seqs] int64 on the device (the next step's input ids)
    host_ids: torch.Tensor
    done: torch.cuda.Event | None
    rows: list[int] | None = None  # only these rows of host_ids (see select)

    @classmethod
    def start_copy(cls, token_ids: torch.Tensor, device: torch.device) -> "StepHandle":
        if device.type != "cuda":
            return cls(token_ids, token_ids, None)
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(token_ids, host_ids, done)

    def select(self, rows: list[int]) -> "StepHandle":
        """The same step's samples, restricted to `rows` (the sequences still running)."""
        index = torch.tensor(rows, dtype=torch.int64)
        if self.token_ids.is_cuda:
            index = index.pin_memory().to(self.token_ids.device, non_blocking=True)
        return StepHandle(self.token_ids[index], self.host_ids, self.done, rows)

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        ids = self.host_ids.tolist()
        return ids if self.rows is None else [ids[i] for i in self.rows]
