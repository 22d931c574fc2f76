"""The ModelRunner: owns the model and the paged KV cache, turns scheduled sequences into tensors,
runs the forward pass and samples the next tokens.

    SchedulerOutput --prepare_prefill/prepare_decode--> input_ids, positions, AttentionMetadata
                    --model--> hidden states --last token of each sampled seq--> logits --Sampler--> token ids

A step with prompt tokens (a prefill, or a mixed step of decode rows and prompt chunks) replays
piecewise CUDA graphs with attention run eagerly between them (or runs eagerly); a decode-only step
replays a CUDA graph.

vLLM: vllm/v1/worker/gpu_model_runner.py; nano-vllm: nanovllm/engine/model_runner.py.
"""
import gc
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.config import Config
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.kernels.quant_fp8 import is_fp8
from minivllm.layers.attention import Attention
from minivllm.engine.cuda_graph import CUDAGraphRunner, DecodeBuffers, graph_batch_size_for
from minivllm.engine.prompt_graphs import PromptGraphRunner, prompt_graph_sizes
from minivllm.layers.sampler import (LogprobsTensors, Sampler, SamplingTensors, compute_logprobs,
                                     gather_logprobs)
from minivllm.models.transformer import head_dim_of
from minivllm.utils.context import AttentionMetadata, set_forward_context
from minivllm.utils.distributed import all_reduce_min, device_for_rank
from minivllm.utils.loader import build_model

logger = logging.getLogger("minivllm")

PROMPT_LOGPROBS_CHUNK = 1024  # prompt positions whose vocabulary-wide logprobs are held at once

# How a mixed step (decode rows + prompt chunks, chunked prefill) attends, per layer:
#   split:   the decode rows through the decode kernel (and its split-K merge), the chunks through
#            the prefill kernel, the two outputs concatenated: three or four launches.
#   unified: each decode row packed as a 1-token chunk whose prefix is all in the paged cache (its
#            own K/V was just stored), the whole step in one prefill-kernel launch.
# Unified saves the decode, merge and cat launches of every layer: host time, which is most of a
# small mixed step (its eager attention runs between replayed graph pieces). But the prefill kernel
# gives each decode row a query tile of its own and reads its whole context in one program, so GPU
# time grows with decode rows x context: on an H200, 64 decode rows of 2048 tokens of context + a
# 2048-token chunk took 0.634 ms per layer unified against 0.301 ms split (benchmarks/bench_prefill.py,
# the ours_unified row). `auto` takes unified for steps of at most UNIFIED_MIXED_MAX_TOKENS tokens.
# MINIVLLM_MIXED_ATTENTION=split|unified|auto (read when a ModelRunner is built) picks the rule.
UNIFIED_MIXED_MAX_TOKENS = 512
MIXED_ATTENTION_ENV = "MINIVLLM_MIXED_ATTENTION"
MIXED_ATTENTION_MODES = ("split", "unified", "auto")


def mixed_attention_from_env() -> str:
    """The mixed-step attention rule the environment asks for (default auto); an unknown one is an error."""
    mode = os.environ.get(MIXED_ATTENTION_ENV, "auto").strip().lower() or "auto"
    if mode not in MIXED_ATTENTION_MODES:
        raise ValueError(f"{MIXED_ATTENTION_ENV}={mode!r}: choose one of {', '.join(MIXED_ATTENTION_MODES)}")
    if MIXED_ATTENTION_ENV in os.environ:  # (a server's log shows that the setting reached the engine's process)
        logger.info("mixed steps' attention: %s (%s)", mode, MIXED_ATTENTION_ENV)
    return mode


def leave_a_core_free(num_ranks: int = 1):
    """On the CPU, run torch's intra-op pool on all cores but one, shared between the tensor-parallel
    ranks (each rank is a process with a pool of its own), unless the user chose a count.

    torch's default pool spans every core, but the engine's Python loop (scheduling, bookkeeping,
    detokenizing) needs one too, and where other processes share the machine a pool as wide as the
    machine waits at each op's barrier for a descheduled thread: on a loaded 2-core machine the demo's
    60 prompts took 32-49 s with 1 thread and had not finished after 400 s with 2. Two ranks, each with
    a pool as wide as the machine, would contend for the same cores in the same way. vLLM's CPU backend
    likewise keeps a core for its front end. torch's thread count is process-wide, so a change is
    logged; OMP_NUM_THREADS or MKL_NUM_THREADS in the environment means the user chose, and nothing is
    changed.
    """
    if "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
        return
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    current = torch.get_num_threads()
    wanted = max(1, min(current, (num_cores - 1) // num_ranks))
    if wanted < current:
        torch.set_num_threads(wanted)
        logger.info("torch.set_num_threads(%d) (was %d on %d cores, %d rank(s)): one core left for the engine's "
                    "loop and other processes; set OMP_NUM_THREADS to choose", wanted, current, num_cores, num_ranks)


def _row_pieces(row: int, num_rows: int) -> list[tuple[int, int]]:
    """(first row, number of rows) of the pieces of rows row .. row + num_rows whose logits are
    computed at once: PROMPT_LOGPROBS_CHUNK rows each, the last one shorter."""
    return [(row + a, min(PROMPT_LOGPROBS_CHUNK, num_rows - a)) for a in range(0, num_rows, PROMPT_LOGPROBS_CHUNK)]


class ModelRunner:
    """One rank's model shard and KV cache. Under tensor parallelism every rank has one: rank 0's is
    driven by the engine and hands each step's inputs to `send_step` (set by the executor, None on a
    single device) before running it; the other ranks' run the steps they receive (executor.py)."""

    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.tp_rank, self.tp_size = rank, config.tensor_parallel_size
        self.device = device_for_rank(config.device, rank) if self.tp_size > 1 else torch.device(config.device)
        self.block_size = config.kvcache_block_size
        self.send_step = None  # tensor parallel, rank 0: callable(input_ids, positions, meta, num_seqs)
        self.mixed_attention = mixed_attention_from_env()  # see UNIFIED_MIXED_MAX_TOKENS
        if self.device.type == "cuda":
            # What the device holds before this engine takes anything: the KV sizing tells this
            # engine's own memory apart from other engines' and processes'.
            start = time.perf_counter()
            gc.collect()  # an engine dropped without shutdown() (a re-run notebook cell) lets go now
            torch.cuda.synchronize(self.device)  # the process's first CUDA call creates its context
            torch.cuda.empty_cache()
            self.free_bytes_at_start = torch.cuda.mem_get_info(self.device)[0]
            logger.info("%s ready in %.1f s", self.device, time.perf_counter() - start)
        else:
            leave_a_core_free(self.tp_size)
        # The noise of unseeded samples: this engine's own generator, so that two engines (or the
        # application) never draw from one another's stream.
        self.generator = torch.Generator().manual_seed(config.seed)
        start = time.perf_counter()
        self.model = build_model(config.model, config.hf_config, config.torch_dtype, self.device,
                                 config.attention_backend, tp_rank=rank, tp_size=self.tp_size,
                                 compile_small_ops=config.compile_small_ops, quantization=config.quantization)
        logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - start)
        if config.quant_config is not None:
            logger.info("FP8 weights (W8A8) in every linear layer: %s", "128 x 128 block scales from the checkpoint"
                        if config.quant_config.is_checkpoint_fp8 else "per-output-channel scales, quantized at load time")
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler(self.generator if self.device.type == "cpu" else None)  # CUDA: Philox seeds instead
        self.memory_report: str | None = None  # how device memory was shared out (CUDA, sized from memory)
        # a sequence at max_model_len plus the token being decoded must fit its block table
        self.max_num_blocks_per_seq = -(-(config.max_model_len + 1) // self.block_size)
        self.use_cuda_graphs = self._use_cuda_graphs()  # KV sizing leaves room for the prompt-step graphs
        self.allocate_kv_cache()
        if self.device.type == "cuda":
            self._warmup_prefill_variants()
        self.decode_buffers = DecodeBuffers(config.max_num_seqs, self.max_num_blocks_per_seq, self.device)
        self.graphs = self.prompt_graphs = None
        if self.use_cuda_graphs:
            self.graphs = CUDAGraphRunner(self.model, self.decode_buffers, config.max_num_seqs)
            self.graphs.capture()
            if prompt_graph_sizes(self._max_prompt_graph_tokens()):
                self.prompt_graphs = PromptGraphRunner(self.model, self.attention_layers,
                                                       self._max_prompt_graph_tokens(), config.torch_dtype, self.device)
                try:
                    self.prompt_graphs.capture(self._prefill_without_cache)
                except Exception as exc:  # fatal (a failed capture can leave the allocator mid-capture), with the way out
                    raise RuntimeError(f"capturing the CUDA graphs of prompt steps failed ({exc}); "
                                       "max_prompt_graph_tokens=0 runs prompt steps eagerly") from exc
        if self.kv_scales is not None and config.calculate_kv_scales:  # after the warm-ups: real prompts only
            for layer in self.attention_layers:
                layer.calculate_kv_scales = True

    def _max_prompt_graph_tokens(self) -> int:
        """The largest prompt step the piecewise graphs take (0: none are captured)."""
        cfg = self.config
        return min(cfg.max_prompt_graph_tokens, cfg.max_num_batched_tokens) if self.use_cuda_graphs else 0

    def _prompt_graph_bytes(self, peak_activation: int) -> int:
        """What the prompt-step graphs will hold once captured (after the KV cache is allocated), so
        that sizing leaves it free: their memory pool, at most the activations of their largest bucket
        (estimated from the profiled step's peak, by token count), their static buffers and each
        bucket's output."""
        sizes = prompt_graph_sizes(self._max_prompt_graph_tokens())
        if not sizes:
            return 0
        cfg, attn = self.config, self.attention_layers[0]
        itemsize = cfg.torch_dtype.itemsize
        seq_len, num_seqs = self._largest_step()
        pool = peak_activation * min(1.0, sizes[-1] / (seq_len * num_seqs))
        buffers = sizes[-1] * (2 * (attn.num_heads + attn.num_kv_heads) * attn.head_dim * itemsize + 20)
        outputs = sum(sizes) * cfg.hf_config.hidden_size * itemsize
        return int(pool + buffers + outputs)

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
        """Bytes of one block across all layers: K and V, block_size tokens, this rank's KV heads."""
        hf = self.config.hf_config
        per_token = 2 * len(self.attention_layers) * self.attention_layers[0].num_kv_heads * head_dim_of(hf)
        return per_token * self.block_size * self.config.kv_cache_torch_dtype.itemsize  # FP8: 1 byte

    def _num_blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            return self._cpu_blocks()
        return self._profile_gpu_blocks()

    def _cpu_blocks(self) -> int:
        """cpu_kvcache_space_bytes of blocks, but no more than max_num_seqs sequences of max_model_len
        tokens can fill: an engine made for a few short sequences (max_num_seqs=4, max_model_len=256)
        takes what they can use, not the whole budget."""
        cfg = self.config
        by_budget = cfg.cpu_kvcache_space_bytes // self.kv_cache_block_bytes()
        enough = cfg.max_num_seqs * self.max_num_blocks_per_seq
        if enough < by_budget:
            logger.info("KV cache on the CPU: max_num_seqs=%d x max_model_len=%d needs %d blocks, fewer than "
                        "cpu_kvcache_space_bytes=%d would hold (%d)", cfg.max_num_seqs, cfg.max_model_len,
                        enough, cfg.cpu_kvcache_space_bytes, by_budget)
        return min(by_budget, enough)

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
        # weights, workspaces, activations (other processes may have freed memory meanwhile: not below 0)
        engine_bytes = max(self.free_bytes_at_start - free, 0) + peak_activation
        others_bytes = total - self.free_bytes_at_start
        # ... less what the prompt-step graphs will hold: captured after the cache, they need the cache's address
        available = min(budget - engine_bytes, free - peak_activation) - self._prompt_graph_bytes(peak_activation)
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

    def _largest_step(self) -> tuple[int, int]:
        """(prompt length, number of prompts) of the largest prefill step the config allows."""
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        return seq_len, max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))

    def _warmup_prefill(self):
        """One forward over the largest step: max_num_batched_tokens tokens in sequences as long as
        one step takes (max_model_len, or the whole budget with chunked prefill). No cache yet."""
        seq_len, num_seqs = self._largest_step()
        hidden, meta = self._forward_without_cache([seq_len] * num_seqs)
        with torch.inference_mode():
            self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
        torch.cuda.synchronize(self.device)
        del hidden

    @torch.inference_mode()
    def _warmup_prefill_variants(self):
        """Compile the prefill kernels' variants now rather than inside the first requests: the
        attention tiles depend on the longest prompt of a step, and a prefix-cache hit reads keys
        through the paged cache (a separate compiled kernel). Nothing is written to the cache."""
        start, bs = time.perf_counter(), self.block_size
        longest = min(self.config.max_model_len, self.config.max_num_batched_tokens)  # one step's chunk at most
        for num_new in sorted({8, min(512, longest), longest}):  # the tile configurations' length classes
            for cached in (0, bs):  # a plain prefill; one that continues a cached first block
                n = min(num_new + cached, self.config.max_model_len)
                if cached >= n:
                    continue
                ids = torch.zeros(n - cached, dtype=torch.int64, device=self.device)
                positions = torch.arange(cached, n, device=self.device)
                table = torch.zeros((1, self.max_num_blocks_per_seq), dtype=torch.int32, device=self.device)
                meta = AttentionMetadata(
                    is_prefill=True, slot_mapping=torch.full((n - cached,), -1, dtype=torch.int32, device=self.device),
                    cu_seqlens_q=self._tensor([0, n - cached]), cu_seqlens_k=self._tensor([0, n]),
                    max_seqlen_q=n - cached, max_seqlen_k=n, block_tables=table if cached else None)
                with set_forward_context(meta):
                    self.model(ids, positions)
        torch.cuda.synchronize(self.device)
        logger.info("prefill kernels warmed up in %.1f s", time.perf_counter() - start)

    def allocate_kv_cache(self):
        cfg, hf = self.config, self.config.hf_config
        start = time.perf_counter()
        num_blocks = cfg.num_kvcache_blocks or self._num_blocks_from_memory()
        if self.tp_size > 1:  # a block id means the same slots on every rank: all take the smallest count
            num_blocks = all_reduce_min(num_blocks, self.device)
        needed = -(-cfg.max_model_len // self.block_size)  # blocks for one sequence of max_model_len tokens
        if num_blocks < needed:
            memory = f" ({self.memory_report})" if self.memory_report else ""
            raise ValueError(
                f"the KV cache fits {num_blocks} blocks of {self.block_size} tokens "
                f"({self.kv_cache_block_bytes() / 2**20:.2f} MiB each){memory}, but one sequence of max_model_len="
                f"{cfg.max_model_len} needs {needed}; lower max_model_len, raise gpu_memory_utilization / "
                f"num_kvcache_blocks, or shut down other engines (LLM.shutdown())")
        self.num_kvcache_blocks = num_blocks  # the engine's resolved config carries it
        attention_layers = self.attention_layers
        # [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads (this rank's), head_dim]
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
        logger.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB), max concurrency %.1f sequences of %d tokens; "
                    "sized and allocated in %.1f s", num_blocks, self.block_size, cfg.kv_cache_torch_dtype,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
                    num_blocks / needed, cfg.max_model_len, time.perf_counter() - start)

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
        for graphs in (self.graphs, self.prompt_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prompt_graphs = self.decode_buffers = self.kv_cache = self.kv_scales = self.model = None
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

    def prepare_prefill(self, seqs: list[Sequence], num_scheduled_tokens: list[int] | None = None,
                        num_decodes: int = 0, use_cache: bool = True, unified: bool = False):
        """Pack the step's tokens back to back (see AttentionMetadata): the first `num_decodes`
        sequences are decode rows (one token each), the others prompt chunks. A sequence's
        scheduled tokens end at seq.num_computed_tokens (the scheduler counted them already);
        num_scheduled_tokens None: every uncached token of each sequence (whole prompts).
        unified: the decode rows are packed as 1-token chunks too (UNIFIED_MIXED_MAX_TOKENS)."""
        num_unified_decodes, num_decodes = (num_decodes, 0) if unified else (0, num_decodes)
        input_ids, positions, slot_mapping = [], [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        for i, seq in enumerate(seqs):
            if num_scheduled_tokens is None:
                start, end = seq.num_cached_tokens, seq.num_tokens
            else:
                end = seq.num_computed_tokens
                start = end - num_scheduled_tokens[i]
            input_ids += seq.token_ids[start:end]
            positions.append(np.arange(start, end))
            slot_mapping.append(self._slots(seq, start, end) if use_cache else np.full(end - start, -1))
            if i >= num_decodes:
                cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
                cu_seqlens_k.append(cu_seqlens_k[-1] + end)
        chunks = seqs[num_decodes:]
        block_tables = None
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:  # a chunk continues a cached prefix: read it from the paged cache
            block_tables = self._block_tables(chunks)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=self._tensor(np.concatenate(slot_mapping).astype(np.int32)),
            cu_seqlens_q=self._tensor(cu_seqlens_q), cu_seqlens_k=self._tensor(cu_seqlens_k),
            max_seqlen_q=max(b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_seqlens_k, cu_seqlens_k[1:])), block_tables=block_tables,
            num_decode_tokens=num_decodes, decode=self._mixed_decode_metadata(seqs[:num_decodes]),
            num_unified_decodes=num_unified_decodes,
        )
        return self._tensor(input_ids, torch.int64), self._tensor(np.concatenate(positions), torch.int64), meta

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), max_num_blocks_per_seq] int32, zero-padded: always the width of the CUDA graphs'
        tables. A Triton kernel is compiled per (value class of) its integer arguments, the row stride
        among them, and the decode kernel's split count follows the width: one width means the
        variants compiled at start-up serve every step, none is compiled in the middle of a request."""
        tables = np.zeros((len(seqs), self.max_num_blocks_per_seq), dtype=np.int32)
        for row, seq in zip(tables, seqs):
            row[:len(seq.block_table)] = seq.block_table
        return self._tensor(tables)

    def _mixed_decode_metadata(self, seqs: list[Sequence]) -> AttentionMetadata | None:
        """The decode rows of a mixed step: each attends to its whole context in the paged cache."""
        if not seqs:
            return None
        context_lens = np.array([seq.num_tokens for seq in seqs], dtype=np.int32)
        return AttentionMetadata(
            is_prefill=False, slot_mapping=None, context_lens=self._tensor(context_lens),
            block_tables=self._block_tables(seqs),
            seq_order=self._tensor(np.argsort(-context_lens, kind="stable")))

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
    def compute_logits(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the last token of each sequence of out.sampled_seqs: [num_sampled, vocab] float32,
        as the LM head's GEMM writes them (`float32_logits`; the sampler reads them as they are). A
        chunk that ends mid-prompt gets none.

        input_ids (decode only): the step's input tokens already on the device (the previous step's
        samples, under async scheduling) instead of each sequence's last token id.
        """
        if out.is_prefill:
            return self._prefill(out)[0]
        seqs = out.seqs
        n = len(seqs)
        # Eager decode pads like the graphs do, so both run the same kernels on the same shapes and
        # give bit-identical results (and CPU tests exercise the padding rows too).
        ids, positions, meta = self.prepare_decode(seqs, graph_batch_size_for(n, self.config.max_num_seqs))
        if input_ids is not None:
            ids[:n].copy_(input_ids, non_blocking=True)
        if self.send_step is not None:  # tensor parallel: the other ranks run this step too
            self.send_step(ids, positions, meta, n)
        return self.forward_logits(ids, positions, meta, n)

    def forward_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       num_seqs: int, logits_rows: torch.Tensor | None = None,
                       prompt_logprob_pieces: list[tuple[int, int]] = ()) -> torch.Tensor | None:
        """The forward of prepared inputs (a captured graph for a decode of a captured size) and the
        logits of the sampled rows (None on ranks other than 0 under tensor parallelism).

        Prefill (and mixed) steps name their rows: `logits_rows`, then the (first row, number of rows)
        pieces whose logits give prompt logprobs, in the order rank 0 computes them (its
        `_prompt_logprobs`): every rank computes its vocabulary shard of the same rows in the same
        order, so that rank 0 can gather them. The pieces come cut already (`_row_pieces` on rank 0),
        so no rank relies on its own PROMPT_LOGPROBS_CHUNK matching rank 0's."""
        if meta.is_prefill:
            hidden, logits = self._forward_prefill(ids, positions, meta, logits_rows)
            for row, num_rows in prompt_logprob_pieces:  # the other ranks' part of rank 0's _prompt_logprobs
                self.model.compute_logits(hidden[row:row + num_rows])
            return logits
        padded = ids.shape[0]
        if self.graphs is not None and padded in self.graphs.graphs:
            hidden = self.graphs.replay(padded)
        else:
            with set_forward_context(meta):
                hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden[:num_seqs])

    @staticmethod
    def _logits_indices(out: SchedulerOutput) -> list[int]:
        """Row of each sampled sequence's last scheduled token in the packed step."""
        sampled, indices, end = {seq.seq_id for seq in out.sampled_seqs}, [], 0
        for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens):
            end += num_tokens
            if seq.seq_id in sampled:
                indices.append(end - 1)
        return indices

    @staticmethod
    def _prompt_logprob_spans(out: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
        """(seq, first row in the packed step, first position, end position) of each chunk whose
        positions predict prompt tokens for a sequence that asked for prompt logprobs (position p's
        logits predict token p + 1; the last prompt position predicts a new token, not a prompt token)."""
        spans, row = [], 0
        for seq, num_tokens in zip(out.seqs, out.num_scheduled_tokens):
            start = seq.num_computed_tokens - num_tokens  # the chunk's first position
            end = min(seq.num_computed_tokens, seq.num_tokens - 1)
            if seq.needs_prompt_logprobs and end > start:
                spans.append((seq, row, start, end))
            row += num_tokens
        return spans

    def is_unified_mixed_step(self, out: SchedulerOutput) -> bool:
        """Does this step's attention run its decode rows as 1-token chunks, in the chunks' prefill
        launch (see UNIFIED_MIXED_MAX_TOKENS)? Only a mixed step can."""
        if not (out.num_decodes and out.is_prefill) or self.mixed_attention == "split":
            return False
        return self.mixed_attention == "unified" or out.num_batched_tokens <= UNIFIED_MIXED_MAX_TOKENS

    def _prefill(self, out: SchedulerOutput) -> tuple[torch.Tensor, dict[tuple[int, int], LogprobsTensors] | None]:
        """The sampled sequences' last-token logits, and the prompt logprobs of the chunks that ask.
        Rows are the step's tokens in out.seqs order however attention is packed (split or unified)."""
        ids, positions, meta = self.prepare_prefill(out.seqs, out.num_scheduled_tokens, out.num_decodes,
                                                    unified=self.is_unified_mixed_step(out))
        logits_rows = self._tensor(self._logits_indices(out), torch.int64)
        spans = self._prompt_logprob_spans(out)
        if self.send_step is not None:  # tensor parallel: the other ranks run this step too
            self.send_step(ids, positions, meta, len(out.seqs), logits_rows,
                           [piece for _, row, start, end in spans for piece in _row_pieces(row, end - start)])
        hidden, logits = self._forward_prefill(ids, positions, meta, logits_rows)
        return logits, (self._prompt_logprobs(spans, hidden) if spans else None)

    def _forward_prefill(self, ids, positions, meta, logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of every new token, and the logits of the rows `logits_rows`. Up to
        max_prompt_graph_tokens tokens replay the piecewise graphs (not while an FP8 cache still
        takes its scales from this prefill: that store runs outside the captured kernels)."""
        pieces = self.prompt_graphs
        if (pieces is not None and pieces.bucket_for(ids.shape[0]) is not None
                and not any(layer.calculate_kv_scales for layer in self.attention_layers)):
            hidden = pieces.run(ids, positions, meta)
        else:
            with set_forward_context(meta):
                hidden = self.model(ids, positions)
        return hidden, self.model.compute_logits(hidden[logits_rows])

    def _prefill_without_cache(self, num_tokens: int):
        """One eager forward of num_tokens prompt tokens (in prompts of at most max_model_len tokens:
        positions stay inside the RoPE table) that writes nothing to the cache."""
        longest, rest = self.config.max_model_len, num_tokens % self.config.max_model_len
        self._forward_without_cache([longest] * (num_tokens // longest) + ([rest] if rest else []))

    def _forward_without_cache(self, lengths: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """(hidden states, metadata) of one eager forward over prompts of these lengths (token 0
        throughout) that writes nothing to the cache."""
        seqs = [Sequence([0] * n, block_size=self.block_size) for n in lengths]
        ids, positions, meta = self.prepare_prefill(seqs, use_cache=False)
        with torch.inference_mode(), set_forward_context(meta):
            return self.model(ids, positions), meta

    def _span_logits(self, hidden: torch.Tensor, row: int, num_rows: int):
        """(a, b, logits of rows row + a .. row + b) over a span, a piece (`_row_pieces`) at a time:
        the vocabulary-wide logits of a long prompt are never all held at once."""
        for first, n in _row_pieces(row, num_rows):
            yield first - row, first - row + n, self.model.compute_logits(hidden[first:first + n])

    def _prompt_logprobs(self, spans: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor
                         ) -> dict[tuple[int, int], LogprobsTensors]:
        """(seq_id, first position) -> logprobs of the prompt tokens that this step's chunks predict
        (`_prompt_logprob_spans`). Such a sequence skipped the prefix cache, so its chunks cover the
        whole prompt."""
        result = {}
        for seq, row, start, end in spans:
            assert seq.num_cached_tokens == 0, "prompt logprobs need every prompt position computed"
            k = seq.sampling_params.prompt_logprobs
            next_ids = self._tensor(seq.token_ids[start + 1:end + 1], torch.int64)  # [end - start]
            parts = [gather_logprobs(compute_logprobs(logits), next_ids[a:b], k)
                     for a, b, logits in self._span_logits(hidden, row, end - start)]
            result[seq.seq_id, start] = LogprobsTensors(torch.cat([p.logprob_token_ids for p in parts]),
                                                        torch.cat([p.logprobs for p in parts]),
                                                        torch.cat([p.ranks for p in parts]))
        return result

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, input_ids: torch.Tensor | None = None) -> "StepHandle":
        """Queue one step's forward and sampling on the device; the sampled ids (one per sequence
        of out.sampled_seqs, and any logprobs) arrive later (`collect`). Nothing here waits for the device."""
        if out.is_prefill:
            logits, prompt_logprobs = self._prefill(out)
        else:
            logits, prompt_logprobs = self.compute_logits(out, input_ids), None
        seqs = out.sampled_seqs
        if not seqs:  # one prompt chunk that ends mid-prompt: nothing to sample
            return StepHandle.start_copy(torch.empty(0, dtype=torch.int64, device=self.device), self.device,
                                         None, prompt_logprobs)
        tensors = SamplingTensors.from_sequences(seqs, logits.shape[-1], logits.device, self.config.eos_token_id,
                                                 generator=self.generator, input_ids=input_ids)
        if tensors.max_num_logprobs is None:  # the plain path
            return StepHandle.start_copy(self.sampler.sample(logits, tensors), self.device, None, prompt_logprobs)
        raw_logprobs = compute_logprobs(logits)  # before penalties and temperature (vLLM's raw logprobs)
        token_ids = self.sampler.sample(logits, tensors)  # [num_seqs] int64, on the device
        logprobs = gather_logprobs(raw_logprobs, token_ids, tensors.max_num_logprobs)
        return StepHandle.start_copy(token_ids, self.device, logprobs, prompt_logprobs)

    def collect(self, handle: "StepHandle") -> list[int]:
        return handle.wait()

    def run(self, out: SchedulerOutput) -> list[int]:
        return self.collect(self.launch(out))


@dataclass
class StepHandle:
    """Sampled token ids on their way to the host: a non-blocking copy into pinned memory plus an
    event, so the host can schedule the next step while the device still computes this one."""

    token_ids: torch.Tensor  # [num_seqs] int64 on the device (the next step's input ids)
    host_ids: torch.Tensor
    done: torch.cuda.Event | None
    rows: list[int] | None = None  # only these rows of host_ids (see select)
    logprobs: LogprobsTensors | None = None  # host copies, one row per row of host_ids
    prompt_logprobs: dict[tuple[int, int], LogprobsTensors] | None = None  # (seq_id, first position) -> host copy

    @classmethod
    def start_copy(cls, token_ids: torch.Tensor, device: torch.device, logprobs: LogprobsTensors | None = None,
                   prompt_logprobs: dict[tuple[int, int], LogprobsTensors] | None = None) -> "StepHandle":
        if device.type != "cuda":
            return cls(token_ids, token_ids, None, None, logprobs, prompt_logprobs)
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        # Logprobs ride with the ids: their copies are queued before the same event.
        if logprobs is not None:
            logprobs = logprobs.to_host(pin=True)
        if prompt_logprobs is not None:
            prompt_logprobs = {key: t.to_host(pin=True) for key, t in prompt_logprobs.items()}
        done = torch.cuda.Event()
        done.record()
        return cls(token_ids, host_ids, done, None, logprobs, prompt_logprobs)

    def select(self, rows: list[int]) -> "StepHandle":
        """The same step's samples, restricted to `rows` (the sequences still running)."""
        index = torch.tensor(rows, dtype=torch.int64)
        if self.token_ids.is_cuda:
            index = index.pin_memory().to(self.token_ids.device, non_blocking=True)
        return StepHandle(self.token_ids[index], self.host_ids, self.done, rows, self.logprobs, self.prompt_logprobs)

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        ids = self.host_ids.tolist()
        return ids if self.rows is None else [ids[i] for i in self.rows]

    def logprobs_lists(self) -> list[tuple[list[int], list[float], int]] | None:
        """After `wait`: per row, (token ids, logprobs, rank of the sampled token); each row's
        lists hold the sampled token then the batch's top-k (the caller keeps the request's k)."""
        if self.logprobs is None:
            return None
        rows = list(zip(*self.logprobs.tolists()))
        return rows if self.rows is None else [rows[i] for i in self.rows]
