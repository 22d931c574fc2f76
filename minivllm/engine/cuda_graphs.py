"""CUDA graphs for decode: capture the model's forward once per batch size, replay it every step.

A decode step launches hundreds of small kernels; replaying a captured graph launches them all at
once. A graph replays fixed pointers, so its inputs live in static buffers that each step refills:

    pinned host staging  --one copy-->  device buffer  (read by every captured graph)
    [ input_ids | positions | slot_mapping | context_lens | seq_order | block_tables (max_batch x max_blocks) ]

A batch of n runs the smallest captured size >= n; rows n.. are padding with slot -1 (store
nothing) and context length 0 (attend to nothing). `CUDAGraphRunner` captures and replays the
graphs; `DecodeCUDAGraphs` is the ModelRunner layer: it fills the staging buffer (`prepare_decode`),
copies it over (`upload`) and replays (`forward`).
vLLM: vllm/v1/worker/gpu_model_runner.py (capture_model); nano-vllm: ModelRunner.capture_cudagraph.
"""
import logging
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

from minivllm.core.attention import set_forward_context
from minivllm.core.model_runner import Batch, StepInputs

logger = logging.getLogger("minivllm")

_VECTORS = ("input_ids", "positions", "slot_mapping", "context_lens", "seq_order")


class DecodeBuffers:
    """The static decode inputs, as one int32 buffer on the host (pinned) and its device twin."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device):
        self.max_batch_size, self.max_blocks_per_seq = max_batch_size, max_blocks_per_seq
        size = max_batch_size * (len(_VECTORS) + max_blocks_per_seq)
        # Two host buffers, used in turn: with async scheduling the host fills step N+1's inputs while
        # step N's upload may still wait in the stream, so it must not overwrite N's buffer. Pinned on
        # CUDA (the copy is then a DMA that does not block); the tests build the layer on a CPU too.
        pinned = torch.device(device).type == "cuda"
        self.hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_views = [self._split(host.numpy()) for host in self.hosts]
        for views in self.host_views:
            views.seq_order[:] = range(max_batch_size)  # a valid permutation of every prefix
        self.device_views = self._split(self.device)
        # What each host buffer's block-table rows hold: (the sequence's block_table list, entries
        # written). A running sequence's table only grows, so a step rewrites only its new entries.
        self.block_rows = [[(None, 0)] * max_batch_size for _ in self.hosts]
        self.current = 0

    def _split(self, flat):
        b = self.max_batch_size
        vectors = {name: flat[i * b:(i + 1) * b] for i, name in enumerate(_VECTORS)}
        return SimpleNamespace(**vectors, block_tables=flat[len(_VECTORS) * b:].reshape(b, self.max_blocks_per_seq))

    def next_host_buffer(self) -> SimpleNamespace:
        """Switch to the other host buffer before filling a new step's inputs; its views."""
        self.current = (self.current + 1) % len(self.hosts)
        return self.host_views[self.current]

    def write_block_tables(self, tables: list[list[int]]):
        """Row i of the current host buffer's block tables <- tables[i], writing only what changed."""
        rows, host = self.block_rows[self.current], self.host_views[self.current].block_tables
        for i, table in enumerate(tables):
            written_table, written = rows[i]
            if written_table is not table:
                written = 0
            if written < len(table):
                host[i, written:len(table)] = table[written:]
                rows[i] = (table, len(table))

    def holds(self, inputs: StepInputs) -> bool:
        """Are these inputs views of the current host buffer (filled by prepare_decode)?"""
        return np.shares_memory(inputs.input_ids, self.host_views[self.current].input_ids)

    def write(self, inputs: StepInputs):
        """Copy decode inputs made elsewhere (another rank's) into a host buffer."""
        views, n = self.next_host_buffer(), len(inputs.input_ids)
        for name in _VECTORS:
            getattr(views, name)[:n] = getattr(inputs, name)
        views.block_tables[:n] = inputs.block_tables
        self.block_rows[self.current] = [(None, 0)] * self.max_batch_size

    def upload(self):
        self.device.copy_(self.hosts[self.current], non_blocking=True)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (at most 512), and max_num_seqs itself."""
    limit = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 16))
    return sorted(set(sizes + [limit]))


def graph_batch_size_for(num_seqs: int, max_num_seqs: int) -> int:
    """The captured batch size a decode of `num_seqs` runs at (itself when beyond the largest)."""
    return next((bs for bs in graph_batch_sizes(max_num_seqs) if bs >= num_seqs), num_seqs)


class CUDAGraph:
    """A torch.cuda.CUDAGraph behind the calls CUDAGraphRunner makes. The tests hand the runner a fake
    with the same methods (capture records fn, replay calls it again), to grade it on a CPU."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn, pool=None):
        """Record the kernels fn() launches, their memory from `pool` (None: a pool of its own)."""
        with torch.cuda.graph(self.graph, pool):
            fn()

    def pool(self):
        """The handle of this graph's memory pool, for the captures that share it."""
        return self.graph.pool()

    def replay(self):
        self.graph.replay()

    def reset(self):
        self.graph.reset()


class CUDAGraphRunner:
    """One captured graph per decode batch size, all writing the same output buffer."""

    def __init__(self, model, max_num_seqs: int, graph_class=CUDAGraph):
        self.model, self.graph_class = model, graph_class
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch_size = self.batch_sizes[-1]
        self.graphs: dict = {}  # batch size -> its graph
        self.outputs = None  # [max_batch_size, hidden] written by every graph

    @torch.inference_mode()
    def capture(self, batch_of_size):
        """batch_of_size(bs): the Batch over the static buffers' first bs rows."""
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory pool
            batch = batch_of_size(bs)
            graph = self.graph_class()
            with set_forward_context(batch.attn):
                out = self.model(batch.input_ids, batch.positions)  # warm-up: compiles kernels, sets up allocator
                if self.outputs is None:
                    self.outputs = out.new_empty(self.max_batch_size, out.shape[-1])
                graph.capture(partial(self._forward_into_outputs, batch), pool)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        for graph in self.graphs.values():  # a graph's first replay uploads it (ms): not in a request
            graph.replay()

    def _forward_into_outputs(self, batch: Batch):
        """What a graph records: the forward over the static inputs, into the static outputs' rows."""
        self.outputs[:len(batch.input_ids)] = self.model(batch.input_ids, batch.positions)

    def release(self):
        """Drop every graph; their private memory pool goes back to the allocator with the last one."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs = None

    def batch_size_for(self, num_seqs: int) -> int:
        return graph_batch_size_for(num_seqs, self.max_batch_size)

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.outputs[:batch_size]


class DecodeCUDAGraphs:
    """ModelRunner layer: decode steps through captured graphs (hooks: __init__, prepare_decode,
    upload, forward, shutdown)."""

    graph_class = CUDAGraph  # what CUDAGraphRunner captures into (the tests' fake graph on a CPU)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rows = self.max_decode_rows()
        self.decode_buffers = DecodeBuffers(rows, self.max_num_blocks_per_seq, self.device)
        self.graphs = CUDAGraphRunner(self.model, rows, self.graph_class)
        for views in self.decode_buffers.host_views:  # capture runs write and read nothing
            views.slot_mapping[:], views.context_lens[:] = -1, 0
        self.decode_buffers.upload()
        self._capture_graphs()

    def _capture_graphs(self):
        """Capture every graph; log the time and the device memory it took (free memory: the graphs'
        pool is reserved, not "allocated"). On a CPU, where the tests capture fake graphs, no memory."""
        on_cuda = self.device.type == "cuda"
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0] if on_cuda else 0
        self.graphs.capture(lambda bs: self._static_batch(self._padded_inputs(bs, bs)))
        if on_cuda:
            torch.cuda.synchronize()
        taken_bytes = free_before - torch.cuda.mem_get_info()[0] if on_cuda else 0
        logger.info("captured %d CUDA graphs (batch sizes 1..%d) in %.1f s, %.2f GiB", len(self.graphs.graphs),
                    self.graphs.max_batch_size, time.perf_counter() - start, taken_bytes / 2**30)

    def _padded_inputs(self, n: int, padded: int) -> StepInputs:
        """StepInputs over the current host buffer's first `padded` rows, `n` of them real."""
        views = self.decode_buffers.host_views[self.decode_buffers.current]
        return StepInputs(views.input_ids[:padded], views.positions[:padded], views.slot_mapping[:padded],
                          np.arange(n, dtype=np.int64), views.block_tables[:padded], False,
                          context_lens=views.context_lens[:padded], seq_order=views.seq_order[:padded],
                          num_decodes=padded)

    def prepare_decode(self, seqs) -> StepInputs:
        """One new token per sequence, staged in the pinned host buffer, padded to a captured size."""
        n = len(seqs)
        if n > self.graphs.max_batch_size:  # beyond the largest graph: the eager path
            return super().prepare_decode(seqs)
        padded = self.graphs.batch_size_for(n)
        host, bs = self.decode_buffers.next_host_buffer(), self.block_size
        lens = [seq.num_tokens for seq in seqs]
        host.input_ids[:n] = [seq.token_ids[-1] for seq in seqs]
        host.context_lens[:n] = lens
        host.positions[:n] = host.context_lens[:n] - 1
        host.slot_mapping[:n] = [seq.block_table[(m - 1) // bs] * bs + (m - 1) % bs for seq, m in zip(seqs, lens)]
        self.decode_buffers.write_block_tables([seq.block_table for seq in seqs])
        host.input_ids[n:padded] = 0  # padding rows: a valid token id,
        host.slot_mapping[n:padded] = -1  # write nothing,
        host.context_lens[n:padded] = 0  # attend to nothing
        # attention visits the longest contexts first (a shorter kernel tail); padding rows go last
        host.seq_order[:padded] = np.argsort(-host.context_lens[:padded], kind="stable")
        return self._padded_inputs(n, padded)

    def upload(self, inputs: StepInputs) -> Batch:
        if inputs.is_prefill or len(inputs.input_ids) > self.graphs.max_batch_size:
            return super().upload(inputs)
        if not self.decode_buffers.holds(inputs):  # (inputs another rank prepared)
            self.decode_buffers.write(inputs)
        self.decode_buffers.upload()
        return self._static_batch(inputs)

    def _static_batch(self, inputs: StepInputs) -> Batch:
        """The Batch over the device buffer's first rows (the graphs' fixed addresses)."""
        views, rows = self.decode_buffers.device_views, len(inputs.input_ids)
        return self.make_batch(inputs, lambda name: getattr(views, name)[:rows])

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.attn.is_prefill or len(batch.input_ids) not in self.graphs.graphs:
            return super().forward(batch)
        return self.graphs.replay(len(batch.input_ids))

    def shutdown(self):
        if self.model is not None:
            self.graphs.release()
            self.graphs = self.decode_buffers = None  # (the graph runner holds the model)
        super().shutdown()
