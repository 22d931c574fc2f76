"""CUDA graphs for decode (minivllm/engine/cuda_graphs.py), on a CPU. A fake graph stands in for
torch.cuda.CUDAGraph: capture runs the callable once and keeps it with the step metadata it ran under,
replay calls it again under that metadata, as a real graph relaunches its kernels on the pointers it
recorded. So what the runner captures, in which order and memory pool, from which buffers, and what a
replay returns are checked exactly; then the decode layer's static, padded inputs; then an engine that
decodes through the fake graphs gives the eager engine's tokens.

They grade exercise 07.1 (CUDAGraphRunner and DecodeCUDAGraphs.prepare_decode); the known wrong answers
at the end must fail them.
"""
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.config import Config
from minivllm.core.attention import AttentionMetadata, get_forward_context, set_forward_context
from minivllm.core.engine import Engine
from minivllm.core.model_runner import Batch, ModelRunner
from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import Sequence
from minivllm.engine import cuda_graphs
from minivllm.sampling_params import SamplingParams
from wrong_answers import builds_on_the_engine, case_id, rejected

SIZES_40 = [1, 2, 4, 8, 16, 32, 40]  # graph_batch_sizes(40)


# ------------------------------------------------------------------------------------- the fakes
def current_metadata():
    try:
        return get_forward_context()
    except RuntimeError:
        return None


class RecordWrites(TorchDispatchMode):
    """The storages that the ops run under it write into (what a captured graph's kernels write: the
    fake replays Python, which looks `self.outputs` up again, where a real graph keeps the pointer)."""

    def __init__(self):
        super().__init__()
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for arg, value in zip(schema, values):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self.storages.add(value.untyped_storage().data_ptr())
        return func(*args, **kwargs)


class FakeGraph:
    """What the runner sees of a CUDA graph (cuda_graphs.CUDAGraph's methods). Each test makes its own
    subclass (`fake_graph_class`), whose `events` list the model shares."""

    events: list = []

    def __init__(self):
        self.fn = self.metadata = None
        self.pool_given = self.pool_handle = None
        self.num_replays, self.was_reset = 0, False

    def capture(self, fn, pool=None):
        assert self.fn is None, "a graph is captured once"
        self.pool_given, self.pool_handle = pool, pool if pool is not None else object()
        self.metadata = current_metadata()
        self.events.append(("capture", self))
        with RecordWrites() as writes:
            fn()  # a capture runs fn once (on the GPU it records its kernels instead of running them)
        self.events.append(("end", self))
        self.fn, self.written_storages = fn, writes.storages

    def pool(self):
        assert self.pool_handle is not None, "pool() of a graph that was not captured"
        return self.pool_handle

    def replay(self):
        assert self.fn is not None, "replay of a graph that was not captured (or was reset)"
        self.num_replays += 1
        self.events.append(("replay", self))
        if self.metadata is None:
            self.fn()
        else:
            with set_forward_context(self.metadata):
                self.fn()

    def reset(self):
        self.fn, self.was_reset = None, True


def fake_graph_class():
    return type("Graph", (FakeGraph,), {"events": []})


class FakeModel(torch.nn.Module):
    """hidden row = [token id, position, context length (from the step's metadata, as attention reads
    it), 1]: a replay's output says which inputs it read. Each call is logged in `events`."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def forward(self, input_ids, positions):
        self.events.append(("forward", len(input_ids)))
        context_lens = get_forward_context().context_lens
        return torch.stack([input_ids.float(), positions.float(), context_lens.float(),
                            torch.ones(len(input_ids))], dim=1)  # [rows, 4], a new tensor


class StaticInputs:
    """The static decode buffers of `rows` rows; batch_of_size(bs) is the Batch over their first bs."""

    def __init__(self, rows: int):
        self.input_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int32)
        self.context_lens = torch.zeros(rows, dtype=torch.int32)
        self.seq_order = torch.arange(rows, dtype=torch.int32)
        self.block_tables = torch.zeros(rows, 3, dtype=torch.int32)

    def batch_of_size(self, bs: int) -> Batch:
        attn = AttentionMetadata(False, self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                                 context_lens=self.context_lens[:bs], seq_order=self.seq_order[:bs])
        return Batch(self.input_ids[:bs], self.positions[:bs], slice(0, bs), attn, None)

    def refill(self, seed: int):
        """New inputs, written in place (as DecodeBuffers.upload does): the graphs must read them."""
        rows = len(self.input_ids)
        self.input_ids.copy_(torch.arange(rows) * 3 + seed)
        self.positions.copy_(torch.arange(rows) * 2 + seed)
        self.context_lens.copy_(torch.arange(rows) + 1 + seed)


def captured_runner(max_num_seqs=40):
    graph_class = fake_graph_class()
    runner = cuda_graphs.CUDAGraphRunner(FakeModel(graph_class.events), max_num_seqs, graph_class)
    static = StaticInputs(runner.max_batch_size)
    runner.capture(static.batch_of_size)
    return runner, static, graph_class


def expected_hidden(static: StaticInputs, rows: int) -> torch.Tensor:
    return torch.stack([static.input_ids[:rows].float(), static.positions[:rows].float(),
                        static.context_lens[:rows].float(), torch.ones(rows)], dim=1)


# --------------------------------------------------------------------------- 07.1 CUDAGraphRunner
def test_graph_batch_sizes():
    assert cuda_graphs.graph_batch_sizes(40) == SIZES_40
    assert cuda_graphs.graph_batch_sizes(5) == [1, 2, 4, 5]
    assert cuda_graphs.graph_batch_sizes(600)[-3:] == [480, 496, 512]


def test_one_graph_per_size_captured_largest_first_in_one_pool():
    """A graph for every size, the largest captured first with a pool of its own, every later one in
    that pool; each size's forward run eagerly once before its capture; every graph replayed once
    after the captures (its upload); one output buffer for the largest batch."""
    runner, static, graph_class = captured_runner(40)
    assert runner.batch_sizes == SIZES_40 and runner.max_batch_size == 40
    assert sorted(runner.graphs) == SIZES_40
    events = graph_class.events
    captures = [g for kind, g in events if kind == "capture"]
    size_of = {id(g): bs for bs, g in runner.graphs.items()}
    assert [size_of[id(g)] for g in captures] == sorted(SIZES_40, reverse=True), "capture the largest batch first"
    first = runner.graphs[40]
    assert first.pool_given is None
    assert all(runner.graphs[bs].pool_given is first.pool_handle for bs in SIZES_40[:-1]), (
        "every capture after the first must pass the first graph's pool()")
    for bs, graph in runner.graphs.items():
        at = events.index(("capture", graph))
        warm = [i for i, e in enumerate(events[:at]) if e == ("forward", bs) and not inside_a_capture(events, i)]
        assert warm, f"the forward at {bs} rows was not run eagerly before its capture (warm-up)"
        assert events[at + 1:events.index(("end", graph))] == [("forward", bs)], (
            f"the graph of {bs} must capture the forward over the first {bs} static rows")
        assert graph.num_replays == 1, f"each graph is replayed once right after the captures ({bs})"
        assert graph.written_storages == {runner.outputs.untyped_storage().data_ptr()}, (
            f"the graph of {bs} must write its rows of runner.outputs, the one buffer every graph shares")
    last_capture = max(events.index(("end", g)) for g in runner.graphs.values())
    assert all(events.index(("replay", g)) > last_capture for g in runner.graphs.values())
    assert runner.outputs.shape == (40, 4) and runner.outputs.dtype == torch.float32


def inside_a_capture(events, i) -> bool:
    opened = [e for e in events[:i] if e[0] in ("capture", "end")]
    return bool(opened) and opened[-1][0] == "capture"


def test_a_replay_reads_the_static_inputs_and_returns_rows_of_the_one_output_buffer():
    runner, static, _ = captured_runner(40)
    for seed, bs in ((5, 8), (11, 40), (2, 1), (7, 16)):
        static.refill(seed)  # the next step's inputs, in the same tensors
        before = {size: g.num_replays for size, g in runner.graphs.items()}
        with torch.inference_mode():  # as ModelRunner.execute_model runs it
            out = runner.replay(bs)
        assert out.shape == (bs, 4), f"replay({bs}) returns its {bs} rows, got {tuple(out.shape)}"
        assert torch.equal(out, expected_hidden(static, bs)), (
            f"replay({bs}) did not compute the forward over the static buffers' current contents")
        assert out.data_ptr() == runner.outputs.data_ptr(), "a replay's output is a view of runner.outputs"
        assert {size: g.num_replays - before[size] for size, g in runner.graphs.items()} == {
            size: int(size == bs) for size in runner.graphs}, f"replay({bs}) must replay its graph, and only it"


def test_a_batch_runs_the_smallest_captured_size_that_holds_it():
    graph_class = fake_graph_class()
    runner = cuda_graphs.CUDAGraphRunner(FakeModel(graph_class.events), 40, graph_class)
    assert [runner.batch_size_for(n) for n in range(1, 41)] == [
        next(bs for bs in SIZES_40 if bs >= n) for n in range(1, 41)]
    assert [runner.batch_size_for(n) for n in (41, 64, 1000)] == [41, 64, 1000], (
        "beyond the largest graph a batch runs eagerly, at its own size")
    big = cuda_graphs.CUDAGraphRunner(FakeModel(graph_class.events), 600, graph_class)
    assert (big.max_batch_size, big.batch_size_for(500), big.batch_size_for(513)) == (512, 512, 513)


def test_release_resets_and_forgets_every_graph():
    runner, _, _ = captured_runner(8)
    graphs = list(runner.graphs.values())
    runner.release()
    assert all(g.was_reset for g in graphs) and runner.graphs == {} and runner.outputs is None


# --------------------------------------------------------------- 07.1's inputs: DecodeCUDAGraphs.prepare_decode
ROWS, WIDTH, BS = 8, 4, 4  # the layer's decode rows (graphs of 1, 2, 4, 8), block-table width, block size


def decode_layer():
    """The graph layer over the core ModelRunner, without a model or captured graphs: prepare_decode
    reads the block size, the graphs' sizes and the static buffers."""
    layer = object.__new__(type("ModelRunner", (cuda_graphs.DecodeCUDAGraphs, ModelRunner), {}))
    layer.block_size, layer.max_num_blocks_per_seq = BS, WIDTH
    layer.decode_buffers = cuda_graphs.DecodeBuffers(ROWS, WIDTH, torch.device("cpu"))
    sizes = cuda_graphs.graph_batch_sizes(ROWS)
    layer.graphs = SimpleNamespace(max_batch_size=ROWS, batch_sizes=sizes,
                                   batch_size_for=lambda n: next((bs for bs in sizes if bs >= n), n))
    return layer


def make_seq(num_tokens, block_table):
    """block_table: the sequence's blocks, or the first of its consecutive ones."""
    seq = Sequence(list(range(100, 100 + num_tokens)), block_size=BS)
    if isinstance(block_table, int):
        block_table = range(block_table, block_table + -(-num_tokens // BS))
    seq.block_table = list(block_table)
    return seq


def assert_static(layer, inputs):
    """Every array of `inputs` is a view of the host buffer the layer uploads next."""
    views = layer.decode_buffers.host_views[layer.decode_buffers.current]
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "seq_order", "block_tables"):
        assert np.shares_memory(getattr(inputs, name), getattr(views, name)), (
            f"{name} is not a view of the current host buffer (decode_buffers.next_host_buffer())")
    assert layer.decode_buffers.holds(inputs)


def test_decode_inputs_are_written_into_the_static_buffer_padded_to_the_graph():
    """Three sequences run in the graph of 4: rows 0-2 theirs, row 3 padding; longest first."""
    layer = decode_layer()
    a, b, c = make_seq(5, [3, 6]), make_seq(9, [1, 2, 7]), make_seq(2, [5])
    inputs = layer.prepare_decode([a, b, c])
    assert_static(layer, inputs)
    assert len(inputs.input_ids) == 4, f"3 sequences run in the graph of 4, not {len(inputs.input_ids)} rows"
    assert inputs.input_ids.tolist() == [104, 108, 101, 0]
    assert inputs.positions[:3].tolist() == [4, 8, 1]
    assert inputs.slot_mapping.tolist() == [6 * BS + 0, 7 * BS + 0, 5 * BS + 1, -1]
    assert inputs.context_lens.tolist() == [5, 9, 2, 0]
    assert inputs.seq_order.tolist() == [1, 0, 2, 3], "longest context first, padding rows last"
    assert inputs.block_tables[:3].tolist() == [[3, 6, 0, 0], [1, 2, 7, 0], [5, 0, 0, 0]]
    assert inputs.logits_indices.tolist() == [0, 1, 2] and not inputs.is_prefill


@pytest.mark.parametrize("n, padded", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_each_batch_runs_the_smallest_graph_that_holds_it(n, padded):
    layer = decode_layer()
    inputs = layer.prepare_decode([make_seq(3 + i, 4 * i) for i in range(n)])
    assert_static(layer, inputs)
    assert len(inputs.input_ids) == padded and inputs.context_lens.tolist() == [3 + i for i in range(n)] + [0] * (
        padded - n)


def test_padding_rows_are_reset_whatever_an_earlier_step_left():
    """Eight sequences fill both host buffers; then three use the first buffer again: its rows 3-7
    still hold the first step's sequences, and row 3 must become padding again."""
    layer = decode_layer()
    big = [make_seq(9 + i, 30 + 4 * i) for i in range(ROWS)]
    layer.prepare_decode(big)
    layer.prepare_decode(big)
    small = [make_seq(6, [20, 21]), make_seq(3, [22]), make_seq(7, [23, 24])]
    inputs = layer.prepare_decode(small)
    assert_static(layer, inputs)
    assert inputs.input_ids.tolist() == [105, 102, 106, 0]
    assert inputs.slot_mapping.tolist() == [21 * BS + 1, 22 * BS + 2, 24 * BS + 2, -1], "a padding row stores nothing"
    assert inputs.context_lens.tolist() == [6, 3, 7, 0], "a padding row attends to nothing"
    assert inputs.seq_order.tolist() == [2, 0, 1, 3]
    assert [row[:len(s.block_table)] for row, s in zip(inputs.block_tables.tolist(), small)] == [
        s.block_table for s in small]


def test_beyond_the_largest_graph_decode_runs_eagerly():
    layer = decode_layer()
    seqs = [make_seq(4 + i, 4 * i) for i in range(ROWS + 1)]
    inputs = layer.prepare_decode(seqs)
    eager = ModelRunner.prepare_decode(layer, seqs)
    assert not layer.decode_buffers.holds(inputs) and len(inputs.input_ids) == ROWS + 1
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "seq_order", "block_tables"):
        assert getattr(inputs, name).tolist() == getattr(eager, name).tolist(), name


def test_profile_decode_sets_the_graphs_aside_for_its_eager_steps():
    """benchmarks/profile_decode.py's eager phase: the same layer prepares the core's eager inputs while
    its graphs are set aside, and the graph path again after."""
    from benchmarks.profile_decode import graphs_off

    layer = decode_layer()
    seqs = [make_seq(4 + i, 4 * i) for i in range(3)]
    graphs = layer.graphs
    with graphs_off(layer):
        inputs = layer.prepare_decode(seqs)
        assert len(inputs.input_ids) == 3 and not layer.decode_buffers.holds(inputs)
        assert inputs.input_ids.tolist() == ModelRunner.prepare_decode(layer, seqs).input_ids.tolist()
    assert layer.graphs is graphs and layer.decode_buffers.holds(layer.prepare_decode(seqs))


# ---------------------------------------------------- the engine decoding through the fake graphs
def test_an_engine_decoding_through_the_graphs_gives_the_eager_tokens(qwen3_tiny_dir):
    """Six greedy requests of different lengths: decode batches of 6, 5, ..., 1 replay the graphs of
    8, 4, 2 and 1 (padding rows included) and give the tokens of the core engine without graphs."""
    config = Config(qwen3_tiny_dir, device="cpu", max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8,
                    kvcache_block_size=8)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    tokens, runners = {}, {}
    for graphs in (False, True):
        runner_class = ModelRunner
        if graphs:
            runner_class = type("ModelRunner", (cuda_graphs.DecodeCUDAGraphs, ModelRunner),
                                {"graph_class": fake_graph_class()})
        runner = runner_class(config)
        engine = Engine(Scheduler(replace(config, num_kvcache_blocks=runner.num_kvcache_blocks)), runner)
        seqs = [Sequence(p, SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, min_tokens=3 + 2 * i), 8)
                for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.add(seq)
        while engine.has_unfinished():
            engine.step()
        tokens[graphs], runners[graphs] = [s.completion_token_ids for s in seqs], runner
    assert tokens[True] == tokens[False]
    replays = {bs: g.num_replays - 1 for bs, g in runners[True].graphs.graphs.items()}  # less the upload
    assert all(replays[bs] > 0 for bs in (8, 4, 2, 1)), replays
    runners[True].shutdown()
    assert runners[True].graphs is None


# ------------------------------------------------------------------------------ known wrong answers
def _capture(self, batch_of_size, *, largest_first=True, one_pool=True, warm_up=True, static_inputs=True,
             one_output_buffer=True):
    """The engine's capture, with one thing broken by each keyword set to False."""
    pool = None
    for bs in sorted(self.batch_sizes, reverse=largest_first):
        batch = batch_of_size(bs)
        if not static_inputs:  # the capture's own copies: later steps' inputs never reach the graph
            batch = replace(batch, input_ids=batch.input_ids.clone(), positions=batch.positions.clone())
        graph = self.graph_class()
        with set_forward_context(batch.attn):
            out = self.model(batch.input_ids, batch.positions) if warm_up else None
            if self.outputs is None or not one_output_buffer:
                self.outputs = torch.empty(self.max_batch_size, 4)
            graph.capture(partial(self._forward_into_outputs, batch), pool if one_pool else None)
            del out
        pool = pool or graph.pool()
        self.graphs[bs] = graph
    for graph in self.graphs.values():
        graph.replay()


def replay_all_rows(self, batch_size):
    self.graphs[batch_size].replay()
    return self.outputs


def replay_without_the_graph(self, batch_size):
    graph = self.graphs[batch_size]
    with set_forward_context(graph.metadata):  # the captured forward, run eagerly
        graph.fn()
    return self.outputs[:batch_size]


def replay_the_largest_graph(self, batch_size):
    self.graphs[self.max_batch_size].replay()
    return self.outputs[:batch_size]


def always_the_largest_size(self, num_seqs):
    return max(self.max_batch_size, num_seqs)


def always_eager(self, num_seqs):
    return num_seqs


def the_next_size_up(self, num_seqs):
    return next((bs for bs in self.batch_sizes if bs > num_seqs), num_seqs)


def _prepare_decode(self, seqs, *, eager=False, largest=False, reset_padding=True, longest_first=True):
    """The engine's prepare_decode, with one thing broken by each keyword."""
    n = len(seqs)
    if eager or n > self.graphs.max_batch_size:
        return ModelRunner.prepare_decode(self, seqs)
    padded = self.graphs.max_batch_size if largest else self.graphs.batch_size_for(n)
    host, bs = self.decode_buffers.next_host_buffer(), self.block_size
    lens = [seq.num_tokens for seq in seqs]
    host.input_ids[:n] = [seq.token_ids[-1] for seq in seqs]
    host.context_lens[:n] = lens
    host.positions[:n] = host.context_lens[:n] - 1
    host.slot_mapping[:n] = [seq.block_table[(m - 1) // bs] * bs + (m - 1) % bs for seq, m in zip(seqs, lens)]
    self.decode_buffers.write_block_tables([seq.block_table for seq in seqs])
    if reset_padding:
        host.input_ids[n:padded], host.slot_mapping[n:padded], host.context_lens[n:padded] = 0, -1, 0
    host.seq_order[:padded] = np.argsort(-host.context_lens[:padded], kind="stable") if longest_first else range(padded)
    return self._padded_inputs(n, padded)


def check_padding_reset():
    test_padding_rows_are_reset_whatever_an_earlier_step_left()


def check_graph_choice():
    for n, padded in [(3, 4), (5, 8), (1, 1)]:
        test_each_batch_runs_the_smallest_graph_that_holds_it(n, padded)


@builds_on_the_engine
def test_the_answers_as_the_wrong_ones_write_them_pass():
    """_capture and _prepare_decode with nothing broken are right: each wrong answer differs in one thing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_graphs.CUDAGraphRunner, "capture", _capture)
        patch.setattr(cuda_graphs.DecodeCUDAGraphs, "prepare_decode", _prepare_decode)
        test_one_graph_per_size_captured_largest_first_in_one_pool()
        test_a_replay_reads_the_static_inputs_and_returns_rows_of_the_one_output_buffer()
        test_decode_inputs_are_written_into_the_static_buffer_padded_to_the_graph()
        check_padding_reset()
        check_graph_choice()


def broken(answer, **what):
    """`answer` with the keywords that break it, as a method; named after them (the test's id)."""
    def wrong(self, *args):
        return answer(self, *args, **what)
    wrong.__name__ = answer.__name__.strip("_") + "_" + "_".join(f"{k}_{v}" for k, v in what.items())
    return wrong


REPLAY_CHECK = test_a_replay_reads_the_static_inputs_and_returns_rows_of_the_one_output_buffer
CAPTURE_CHECK = test_one_graph_per_size_captured_largest_first_in_one_pool
LAYER_CHECK = test_decode_inputs_are_written_into_the_static_buffer_padded_to_the_graph


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("capture", broken(_capture, largest_first=False), CAPTURE_CHECK),
    ("capture", broken(_capture, one_pool=False), CAPTURE_CHECK),
    ("capture", broken(_capture, warm_up=False), CAPTURE_CHECK),
    ("capture", broken(_capture, static_inputs=False), REPLAY_CHECK),
    ("capture", broken(_capture, one_output_buffer=False), CAPTURE_CHECK),
    ("replay", replay_all_rows, REPLAY_CHECK),
    ("replay", replay_the_largest_graph, REPLAY_CHECK),
    ("replay", replay_without_the_graph, REPLAY_CHECK),
    ("batch_size_for", always_the_largest_size, test_a_batch_runs_the_smallest_captured_size_that_holds_it),
    ("batch_size_for", always_eager, test_a_batch_runs_the_smallest_captured_size_that_holds_it),
    ("batch_size_for", the_next_size_up, test_a_batch_runs_the_smallest_captured_size_that_holds_it),
], ids=case_id)
def test_the_runner_checks_reject_a_wrong_runner(name, wrong, check):
    rejected(check, cuda_graphs.CUDAGraphRunner, name, wrong)


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (broken(_prepare_decode, eager=True), LAYER_CHECK),
    (broken(_prepare_decode, largest=True), LAYER_CHECK),
    (broken(_prepare_decode, largest=True), check_graph_choice),
    (broken(_prepare_decode, reset_padding=False), check_padding_reset),
    (broken(_prepare_decode, longest_first=False), LAYER_CHECK),
], ids=case_id)
def test_the_layer_checks_reject_a_wrong_prepare_decode(wrong, check):
    rejected(check, cuda_graphs.DecodeCUDAGraphs, "prepare_decode", wrong)
