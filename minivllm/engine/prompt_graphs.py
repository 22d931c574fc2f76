"""Piecewise CUDA graphs for steps with prompt tokens: everything but attention, captured by token count.

A decode step replays one graph of the whole forward (cuda_graphs.py). A step with prompt tokens cannot:
attention's launch depends on how the tokens split into sequences (their count, the longest one, which
ones continue a cached prefix), which changes every step. Run eagerly, though, such a step pays the
host for every kernel it launches: on an H200, 17-23 ms for Qwen3-0.6B whatever the number of tokens,
against 2.9 ms of GPU work for 1024 tokens. So the forward is cut at attention, as vLLM's piecewise
graphs do, and the pieces between are captured once per token count (a bucket):

    | graph 0: embed, norm, qkv, RoPE+store | attention 0, eager |
    | graph 1: o_proj, norm, MLP, norm, qkv, RoPE+store | attention 1, eager | ...
    | graph L: o_proj, norm, MLP, final norm |

A step of T tokens runs the smallest bucket >= T; rows T.. are padding (slot -1: they store nothing;
their token ids and positions are whatever a previous step left). Attention runs on the real rows
only, with the step's own metadata, and its output goes into one static buffer that the next piece
reads. Each piece leaves q, k and v in static buffers too, so that no activation outlives a step.

Capture swaps each attention layer's backend for a `CutAttention` whose `attend` hands q, k, v to
`PieceCapture.cut`: it ends the graph being captured, remembers the layer and begins the next graph,
which reads the static attention-output buffer. `PromptCUDAGraphs` is the ModelRunner layer.
vLLM: vllm/compilation/ (piecewise graphs split at the attention op by torch.compile).
"""
import logging
import time
from collections import Counter
from contextlib import contextmanager

import torch

from minivllm.core.attention import AttentionMetadata, set_forward_context

logger = logging.getLogger("minivllm")


def prompt_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets: powers of two from 16, and from 256 on a 1.5x step between each two, up to
    max_tokens. From 256 on padding wastes at most a third of a step; below, up to half of a few
    hundred tokens, where a step's cost hardly depends on its size."""
    sizes, size = [], 16
    while size <= max_tokens:
        sizes += [size] + ([size * 3 // 2] if size >= 256 and size * 3 // 2 <= max_tokens else [])
        size *= 2
    return sizes


def capture_stream() -> torch.cuda.Stream:
    """The side stream that torch.cuda.graph captures on, one per process. A stream's first matmul
    gives it a cuBLAS workspace (32 MiB on Hopper) that lives as long as the process: a fresh stream
    per engine would keep one more workspace for every engine ever built."""
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


class PieceCapture:
    """The capture in progress: the graphs of one bucket and the cuts between them."""

    def __init__(self, runner: "PromptGraphRunner", num_tokens: int):
        self.runner, self.num_tokens = runner, num_tokens
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[torch.nn.Module] = []  # the Attention layer after each graph but the last
        self._open = False
        self._begin()

    def _begin(self):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.runner.pool)
        self.graphs.append(graph)
        self._open = True

    def _end(self):
        self.graphs[-1].capture_end()
        self._open = False
        if self.runner.pool is None:
            self.runner.pool = self.graphs[-1].pool()

    def abandon(self):
        """After a failure inside the capture: end the open capture, so that the error reported is the
        capture's own (the engine then stops: see ModelRunner)."""
        if self._open:
            self._open = False
            try:
                self.graphs[-1].capture_end()
            except Exception:  # noqa: BLE001 (the capture's own error is the one to report)
                pass

    def cut(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Called by `layer` in place of attention: q, k, v go to the static buffers (inside this
        piece), the piece ends, and the next one begins reading the attention-output buffer."""
        n, buffers = self.num_tokens, self.runner.buffers
        buffers.q[:n].copy_(q)
        buffers.k[:n].copy_(k)
        buffers.v[:n].copy_(v)
        self._end()
        self.cuts.append(layer)
        self._begin()
        return buffers.attn_out[:n]

    def finish(self):
        self._end()


class CutAttention:
    """An attention backend for capture: store as the layer's own backend does, attend by cutting."""

    def __init__(self, inner, capture: PieceCapture):
        self.inner, self.capture = inner, capture

    def store(self, layer, k, v, meta):
        self.inner.store(layer, k, v, meta)

    def attend(self, layer, q, k, v, meta):
        return self.capture.cut(layer, q, k, v)


@contextmanager
def cutting_attention(attention_layers, capture: PieceCapture):
    """While set, every attention layer's `attend` cuts the capture instead of attending."""
    backends = [layer.backend for layer in attention_layers]
    for layer in attention_layers:
        layer.backend = CutAttention(layer.backend, capture)
    try:
        yield
    finally:
        for layer, backend in zip(attention_layers, backends):
            layer.backend = backend


class _StaticBuffers:
    """Device buffers the captured pieces read and write at fixed addresses, for the largest bucket."""

    def __init__(self, max_tokens: int, attn, dtype, device):
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.q = torch.zeros(max_tokens, h, d, dtype=dtype, device=device)
        self.k = torch.zeros(max_tokens, kvh, d, dtype=dtype, device=device)
        self.v = torch.zeros(max_tokens, kvh, d, dtype=dtype, device=device)
        self.attn_out = torch.zeros(max_tokens, h, d, dtype=dtype, device=device)


class PromptGraphRunner:
    """Captures the pieces for every bucket up to `max_tokens` and runs prompt steps through them."""

    def __init__(self, model, attention_layers, max_tokens: int, dtype, device):
        self.model, self.attention_layers = model, attention_layers
        self.sizes = prompt_graph_sizes(max_tokens)
        self.buffers = _StaticBuffers(self.sizes[-1], attention_layers[0], dtype, device)
        self.pool = None
        self.captured: dict[int, PieceCapture] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> the last piece's output [bucket, hidden]
        # steps run through the pieces: prefill, prefix (hits, chunks), mixed (decode rows through the
        # decode kernel), mixed_unified (decode rows as 1-token chunks: model_runner.py)
        self.steps_by_kind = Counter()

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((size for size in self.sizes if size >= num_tokens), None)

    @torch.inference_mode()
    def capture(self, warm_up):
        """warm_up(num_tokens): one eager forward of that many tokens (compiles what the pieces run)."""
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        b = self.buffers
        stream = capture_stream()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            warm_up(size)
            meta = AttentionMetadata(is_prefill=True, slot_mapping=b.slot_mapping[:size])
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), set_forward_context(meta):
                capture = PieceCapture(self, size)
                try:
                    with cutting_attention(self.attention_layers, capture):
                        self.hidden[size] = self.model(b.input_ids[:size], b.positions[:size])
                    capture.finish()
                except BaseException:
                    capture.abandon()
                    raise
            torch.cuda.current_stream().wait_stream(stream)
            assert len(capture.cuts) == len(self.attention_layers), "one cut per attention layer"
            self.captured[size] = capture
        for capture in self.captured.values():  # a graph's first replay uploads it (ms): not in a request
            for graph in capture.graphs:  # (slots are all -1: nothing is stored; the outputs are scratch)
                graph.replay()
        torch.cuda.synchronize()
        logger.info("captured prompt-step graphs for %d token counts (16..%d, %d pieces each) in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[-1], len(self.attention_layers) + 1, time.perf_counter() - start,
                    (free_before - torch.cuda.mem_get_info()[0]) / 2**30)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kind: str) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of an uploaded prompt step (of `kind`, counted in
        steps_by_kind), through the bucket's pieces with eager attention between them."""
        n = input_ids.shape[0]
        size = self.bucket_for(n)
        self.steps_by_kind[kind] += 1
        b, capture = self.buffers, self.captured[size]
        b.input_ids[:n].copy_(input_ids, non_blocking=True)
        b.positions[:n].copy_(positions, non_blocking=True)
        b.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        b.slot_mapping[n:size].fill_(-1)  # padding rows store nothing (their other inputs: whatever is there)
        with set_forward_context(meta):
            for graph, layer in zip(capture.graphs, capture.cuts):
                graph.replay()
                b.attn_out[:n].copy_(layer.backend.attend(layer, b.q[:n], b.k[:n], b.v[:n], meta))
            capture.graphs[-1].replay()
        return self.hidden[size][:n]

    def release(self):
        for capture in self.captured.values():
            for graph in capture.graphs:
                graph.reset()
        self.captured.clear()
        self.hidden.clear()


class PromptCUDAGraphs:
    """ModelRunner layer: prompt steps of up to max_prompt_graph_tokens tokens through the pieces
    (hooks: __init__, bytes_after_kv_cache, forward, shutdown)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.prompt_graphs = PromptGraphRunner(self.model, self.attention_layers, self._max_prompt_graph_tokens(),
                                               cfg.torch_dtype, self.device)
        try:
            self.prompt_graphs.capture(self._prefill_without_cache)
        except Exception as exc:  # fatal (a failed capture can leave the allocator mid-capture), with the way out
            raise RuntimeError(f"capturing the CUDA graphs of prompt steps failed ({exc}); "
                               "max_prompt_graph_tokens=0 runs prompt steps eagerly") from exc

    def _max_prompt_graph_tokens(self) -> int:
        return min(self.config.max_prompt_graph_tokens, self.config.max_num_batched_tokens)

    def _prefill_without_cache(self, num_tokens: int):
        """One eager forward of num_tokens prompt tokens (in prompts of at most max_model_len tokens:
        positions stay inside the RoPE table) that writes nothing to the cache."""
        longest, rest = self.config.max_model_len, num_tokens % self.config.max_model_len
        self.forward_without_cache([longest] * (num_tokens // longest) + ([rest] if rest else []))

    def bytes_after_kv_cache(self, peak_activation: int) -> int:
        """What the graphs will hold once captured (after the KV cache is allocated), so that sizing
        leaves it free: their memory pool, at most the activations of their largest bucket
        (estimated from the profiled step's peak, by token count), their static buffers and each
        bucket's output."""
        sizes = prompt_graph_sizes(self._max_prompt_graph_tokens())
        attn, itemsize = self.attention_layers[0], self.config.torch_dtype.itemsize
        seq_len, num_seqs = self.largest_step()
        pool = peak_activation * min(1.0, sizes[-1] / (seq_len * num_seqs))
        buffers = sizes[-1] * (2 * (attn.num_heads + attn.num_kv_heads) * attn.head_dim * itemsize + 20)
        outputs = sum(sizes) * self.config.hf_config.hidden_size * itemsize
        return int(pool + buffers + outputs) + super().bytes_after_kv_cache(peak_activation)

    def forward(self, batch) -> torch.Tensor:
        pieces, n = self.prompt_graphs, len(batch.input_ids)
        size = pieces.bucket_for(n) if batch.attn.is_prefill else None
        if size is None or size not in pieces.captured:
            return super().forward(batch)
        return pieces.run(batch.input_ids, batch.positions, batch.attn, prompt_step_kind(batch))

    def shutdown(self):
        if self.model is not None:
            self.prompt_graphs.release()
            self.prompt_graphs = None  # (it holds the model)
        super().shutdown()


def prompt_step_kind(batch) -> str:
    """prefill (all new), prefix (hits, chunks), mixed (decode rows through the decode kernel) or
    mixed_unified (decode rows as 1-token chunks: engine/mixed_steps.py)."""
    if batch.inputs.num_decodes:
        return "mixed" if getattr(batch.attn, "num_decode_tokens", 0) else "mixed_unified"
    return "prefix" if batch.attn.block_tables is not None else "prefill"
