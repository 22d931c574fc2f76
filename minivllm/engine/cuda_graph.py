"""CUDA graphs for decode: capture the model's forward once per batch size, replay it every step.

A decode step launches hundreds of small kernels; replaying a captured graph launches them all at
once. A graph replays fixed pointers, so its inputs live in static buffers that each step refills:

    pinned host staging  --one copy-->  device buffer  (read by every captured graph)
    [ input_ids | positions | slot_mapping | context_lens | seq_order | block_tables (max_batch x max_blocks) ]

A batch of n runs the smallest captured size >= n; rows n.. are padding with slot -1 (store
nothing) and context length 0 (attend to nothing). vLLM: vllm/v1/worker/gpu_model_runner.py
(capture_model); nano-vllm: ModelRunner.capture_cudagraph.
"""
import logging
import time
from types import SimpleNamespace

import torch

from minivllm.utils.context import AttentionMetadata, set_forward_context

logger = logging.getLogger("minivllm")

_NUM_VECTORS = 5  # input_ids, positions, slot_mapping, context_lens, seq_order


class DecodeBuffers:
    """The static decode inputs, as one int32 buffer on the host (pinned on CUDA) and its device twin."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device):
        self.max_batch_size, self.max_blocks_per_seq = max_batch_size, max_blocks_per_seq
        size = max_batch_size * (_NUM_VECTORS + max_blocks_per_seq)
        on_cuda = device.type == "cuda"
        # Two host buffers, used in turn: with async scheduling the host fills step N+1's inputs while
        # step N's upload may still wait in the stream, so it must not overwrite N's buffer. (The CPU
        # keeps the same layout, host and "device" apart, so that CPU tests run the same path.)
        self.hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._all_host_views = [self._split(host.numpy()) for host in self.hosts]
        for views in self._all_host_views:
            views.seq_order[:] = range(max_batch_size)  # a valid permutation of every prefix
        self.device_views = self._split(self.device)
        # What each host buffer's block-table rows hold: (the sequence's block_table list, entries
        # written). A running sequence's table only grows, so a step rewrites only its new entries.
        self.block_rows = [[(None, 0)] * max_batch_size for _ in self.hosts]
        self._current = 0

    @property
    def host(self) -> torch.Tensor:
        return self.hosts[self._current]

    @property
    def host_views(self):
        return self._all_host_views[self._current]

    def write_block_tables(self, tables: list[list[int]]):
        """Row i of the current host buffer's block tables <- tables[i], writing only what changed."""
        rows, host = self.block_rows[self._current], self.host_views.block_tables
        for i, table in enumerate(tables):
            written_table, written = rows[i]
            if written_table is not table:
                written = 0
            if written < len(table):
                host[i, written:len(table)] = table[written:]
                rows[i] = (table, len(table))

    def next_host_buffer(self):
        """Switch to the other host buffer before filling a new step's inputs."""
        self._current = (self._current + 1) % len(self.hosts)

    def _split(self, flat):
        b = self.max_batch_size
        vectors = [flat[i * b:(i + 1) * b] for i in range(_NUM_VECTORS)]
        block_tables = flat[_NUM_VECTORS * b:].reshape(b, self.max_blocks_per_seq)
        return SimpleNamespace(input_ids=vectors[0], positions=vectors[1], slot_mapping=vectors[2],
                               context_lens=vectors[3], seq_order=vectors[4], block_tables=block_tables)

    def upload(self):
        self.device.copy_(self.host, non_blocking=True)

    def views(self, batch_size: int):
        """(input_ids, positions, AttentionMetadata) for the first `batch_size` rows of the device buffer."""
        d = self.device_views
        meta = AttentionMetadata(is_prefill=False, slot_mapping=d.slot_mapping[:batch_size],
                                 context_lens=d.context_lens[:batch_size], block_tables=d.block_tables[:batch_size],
                                 seq_order=d.seq_order[:batch_size])
        return d.input_ids[:batch_size], d.positions[:batch_size], meta


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (at most 512), and max_num_seqs itself."""
    limit = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 16))
    return sorted(set(sizes + [limit]))


def graph_batch_size_for(num_seqs: int, max_num_seqs: int) -> int:
    """The captured batch size a decode of `num_seqs` runs at (itself when beyond the largest)."""
    return next((bs for bs in graph_batch_sizes(max_num_seqs) if bs >= num_seqs), num_seqs)


class CUDAGraphRunner:
    def batch_size_for(self, num_seqs: int) -> int:
        return graph_batch_size_for(num_seqs, self.max_batch_size)

    def __init__(self, model, buffers: DecodeBuffers, max_num_seqs: int):
        self.model, self.buffers = model, buffers
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch_size = self.batch_sizes[-1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs = None  # [max_batch_size, hidden] written by every graph

    @torch.inference_mode()
    def capture(self):
        # The graphs' private memory pool is reserved, not "allocated": measure free device memory.
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        for host in self.buffers._all_host_views:
            host.slot_mapping[:], host.context_lens[:] = -1, 0  # capture runs write and read nothing
        self.buffers.upload()
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory pool
            input_ids, positions, meta = self.buffers.views(bs)
            graph = torch.cuda.CUDAGraph()
            with set_forward_context(meta):
                out = self.model(input_ids, positions)  # warm-up: compiles kernels, sets up allocator
                if self.outputs is None:
                    self.outputs = torch.empty(self.max_batch_size, out.shape[-1], dtype=out.dtype, device=out.device)
                with torch.cuda.graph(graph, pool):
                    self.outputs[:bs] = self.model(input_ids, positions)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        for graph in self.graphs.values():  # a graph's first replay uploads it (ms): not in a request
            graph.replay()
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes 1..%d) in %.1f s, %.2f GiB", len(self.graphs),
                    self.max_batch_size, time.perf_counter() - start,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def release(self):
        """Drop every graph; their private memory pool goes back to the allocator with the last one."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs = None

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.outputs[:batch_size]
