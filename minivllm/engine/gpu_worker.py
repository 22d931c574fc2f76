"""The ModelRunner on a CUDA GPU: its memory and its start-up.

    before the model:   note what the device holds already (other engines, other processes)
    num_kv_blocks:      vLLM's sizing: run the largest step the config allows, measure the weights
                        and peak activations, give what is left of gpu_memory_utilization x the
                        card to KV blocks (and leave what the prompt-step graphs will hold)
    after the cache:    compile the prefill kernels' variants now, not inside the first requests
    shutdown:           give every byte back, so a second engine in the process gets the same budget

vLLM: vllm/v1/worker/gpu_worker.py (determine_available_memory) and gpu_model_runner.py (profile_run).
"""
import gc
import logging
import time

import torch

from minivllm.core.attention import set_forward_context
from minivllm.core.sequence import Sequence

logger = logging.getLogger("minivllm")


class CUDAWorker:
    """ModelRunner layer for a CUDA device (hooks: __init__, num_kv_blocks, kv_cache_size_hint, shutdown)."""

    def __init__(self, config, device=None, rank=0):
        device = device or torch.device(config.device)
        start = time.perf_counter()
        gc.collect()  # an engine dropped without shutdown() (a re-run notebook cell) lets go now
        torch.cuda.synchronize(device)  # the process's first CUDA call creates its context
        torch.cuda.empty_cache()
        # What the device holds before this engine takes anything: the KV sizing tells this
        # engine's own memory apart from other engines' and processes'.
        self.free_bytes_at_start = torch.cuda.mem_get_info(device)[0]
        self.memory_report: str | None = None  # how device memory was shared out (sized from memory)
        logger.info("%s ready in %.1f s", device, time.perf_counter() - start)
        super().__init__(config, device, rank)
        self.warm_up_prefill_variants()

    def num_kv_blocks(self) -> int:
        """this engine may use gpu_memory_utilization x total device memory:

            total:  |== other processes / engines ==|== this engine: weights | activations | KV ... ==| free |
                                                     <-- gpu_memory_utilization x total -->
        """
        torch.cuda.reset_peak_memory_stats(self.device)
        self.forward_largest_step()
        stats = torch.cuda.memory_stats(self.device)
        peak_activation = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        utilization = self.config.gpu_memory_utilization
        budget = total * utilization
        # weights, workspaces, activations (other processes may have freed memory meanwhile: not below 0)
        engine_bytes = max(self.free_bytes_at_start - free, 0) + peak_activation
        others_bytes = total - self.free_bytes_at_start
        # ... less what is allocated after the cache (the prompt-step graphs need the cache's address)
        available = min(budget - engine_bytes, free - peak_activation) - self.bytes_after_kv_cache(peak_activation)
        gib = 2**30
        logger.info("GPU memory: total %.1f GiB, budget %.1f GiB (gpu_memory_utilization=%.2f), this engine's "
                    "weights and activations %.2f GiB, held by others %.1f GiB, for KV %.1f GiB",
                    total / gib, budget / gib, utilization, engine_bytes / gib, others_bytes / gib,
                    max(available, 0) / gib)
        self.memory_report = (f"gpu_memory_utilization={utilization} x {total / gib:.1f} GiB = {budget / gib:.1f} GiB "
                              f"for this engine; its weights and activations take {engine_bytes / gib:.2f} GiB; "
                              f"other processes or engines hold {others_bytes / gib:.1f} GiB and {free / gib:.1f} "
                              f"GiB is free")
        return max(0, int(available // self.kv_cache_block_bytes()))

    def bytes_after_kv_cache(self, peak_activation: int) -> int:
        """Device memory allocated after the KV cache (a later layer's, e.g. prompt-step graphs)."""
        return 0

    def kv_cache_size_hint(self) -> str:
        memory = f"; {self.memory_report}" if self.memory_report else ""
        return f"raise gpu_memory_utilization / num_kvcache_blocks, or shut down other engines (LLM.shutdown()){memory}"

    def largest_step(self) -> tuple[int, int]:
        """(prompt length, number of prompts) of the largest prefill step the config allows."""
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        return seq_len, max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))

    def forward_largest_step(self):
        """One forward over the largest step (its LM head included), writing nothing to the cache."""
        seq_len, num_seqs = self.largest_step()
        hidden, batch = self.forward_without_cache([seq_len] * num_seqs)
        self.model.compute_logits(hidden[batch.logits_indices])
        torch.cuda.synchronize(self.device)

    def forward_without_cache(self, lengths: list[int], num_cached: int = 0):
        """(hidden states, batch) of one eager forward over prompts of these lengths (token 0
        throughout, the first num_cached of each continuing a prefix in cache block 0) that writes
        nothing to the cache."""
        seqs = []
        for n in lengths:
            seq = Sequence([0] * n, block_size=self.block_size)
            seq.num_computed_tokens, seq.block_table = n, [0] * -(-n // self.block_size)
            seqs.append(seq)
        batch = self.upload(self.prepare_prefill(seqs, [n - num_cached for n in lengths], use_cache=False))
        with torch.inference_mode(), set_forward_context(batch.attn):  # eager, whatever graphs exist
            return self.model(batch.input_ids, batch.positions), batch

    def warm_up_prefill_variants(self):
        """Compile the prefill kernels' variants now rather than inside the first requests: the
        attention tiles depend on the longest prompt of a step, and a prefix-cache hit reads keys
        through the paged cache (a separate compiled kernel). Nothing is written to the cache."""
        start = time.perf_counter()
        longest = min(self.config.max_model_len, self.config.max_num_batched_tokens)  # one step's chunk at most
        for num_new in sorted({8, min(512, longest), longest}):  # the tile configurations' length classes
            for cached in (0, self.block_size):  # a plain prefill; one that continues a cached first block
                n = min(num_new + cached, self.config.max_model_len)
                if cached < n:
                    self.forward_without_cache([n], cached)
        torch.cuda.synchronize(self.device)
        logger.info("prefill kernels warmed up in %.1f s", time.perf_counter() - start)

    def shutdown(self):
        """Give back everything this runner holds on the device. Idempotent."""
        if self.model is None:
            return
        torch.cuda.synchronize(self.device)
        super().shutdown()
        gc.collect()  # the model's modules reference each other (cycles)
        torch.cuda.empty_cache()
