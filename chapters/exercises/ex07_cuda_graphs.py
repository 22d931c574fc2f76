"""Chapter 07 exercise: decode CUDA graphs, captured and replayed: the graph runner that captures one
graph per decode batch size and replays it, and the decode inputs it replays on
(minivllm/engine/cuda_graphs.py). Exercise 07.1 is the class and the method: write both; `make exercise
CH=07` runs the graphs' tests with them. Stuck? chapters/exercises/hints/07_cuda_graphs.md, one level at
a time.

The class replaces CUDAGraphRunner: the layer DecodeCUDAGraphs builds one
(`CUDAGraphRunner(self.model, rows, self.graph_class)`) and calls the methods below. prepare_decode
replaces the method DecodeCUDAGraphs.prepare_decode (`self` is the layer). Both are graded on a CPU: the
tests pass a fake graph in place of cuda_graphs.CUDAGraph (the same four methods), whose replay calls the
captured callable again; on a GPU the same code captures real graphs.
"""
import numpy as np  # noqa: F401 (for your prepare_decode)
import torch

from minivllm.core.attention import set_forward_context  # noqa: F401 (for your capture)
from minivllm.core.model_runner import StepInputs
from minivllm.core.sequence import Sequence
from minivllm.engine.cuda_graphs import CUDAGraph, DecodeCUDAGraphs, graph_batch_sizes  # noqa: F401


def _not_written(method: str) -> NotImplementedError:
    return NotImplementedError(f"exercise 07.1 (CUDAGraphRunner) is not written yet: CUDAGraphRunner.{method}; "
                               "fill it in, chapters/exercises/ex07_cuda_graphs.py; read chapters/07_cuda_graphs.md, "
                               "'6. What graphs cost in memory, and sharing one pool'")


class CUDAGraphRunner:
    """Exercise 07.1, capture and replay: one captured graph per decode batch size, all writing one output buffer (chapter
    07, sections 2, 4 and "6. What graphs cost in memory, and sharing one pool").

    Attributes that other code reads (keep the names):
        model:           model(input_ids, positions) -> hidden [rows, hidden], reading the step's
                         attention metadata (set_forward_context) as the engine's model does
        batch_sizes:     the sizes to capture, graph_batch_sizes(max_num_seqs) (given), ascending
        max_batch_size:  the largest of them
        graphs:          dict, batch size -> its captured graph ({} before capture and after release)
        outputs:         the one tensor [max_batch_size, hidden] (the model's dtype and device) that
                         every graph writes its rows into; None before capture and after release

    A graph comes from graph_class() (cuda_graphs.CUDAGraph on a GPU) and has four methods:
        graph.capture(fn, pool)  records what fn() launches; its memory comes from `pool`, a handle
                                 another graph's pool() gave, or None: a pool of its own
        graph.pool()             the handle of the pool it captured in
        graph.replay()           launches what it recorded, on the same memory addresses
        graph.reset()            frees it
    On a CPU the tests' fake graph runs fn once at capture and calls it again at each replay, under
    the attention metadata that was set when it was captured: fn must read only what the graph
    would have recorded (the static tensors of its batch size), not a variable that changes later.
    """

    def __init__(self, model, max_num_seqs: int, graph_class=CUDAGraph):
        raise _not_written("__init__")

    @torch.inference_mode()
    def capture(self, batch_of_size):
        """One graph for every size of batch_sizes. batch_of_size(bs) is the Batch (minivllm/core/
        model_runner.py: input_ids, positions, attn) over the first bs rows of the static input
        buffers: the same tensors whenever it is asked, refilled in place before every replay.

        A graph of bs rows records the model's forward over that batch, under its attention metadata,
        writing the result into rows 0 .. bs-1 of `outputs`. Before capturing a size, run its forward
        once eagerly: kernels compile and the allocator settles there, never inside a capture. The
        graphs run one at a time, so they share one memory pool, which the first graph captured makes
        and must be large enough for every later one. After the last capture replay each graph once
        (a graph's first replay uploads it, milliseconds no request should wait for).
        """
        raise _not_written("capture")

    def release(self):
        """Reset every graph, then forget them and the output buffer."""
        raise _not_written("release")

    def batch_size_for(self, num_seqs: int) -> int:
        """The size a decode of num_seqs sequences runs at: the smallest captured size that holds it;
        num_seqs itself when no graph does (that step runs eagerly)."""
        raise _not_written("batch_size_for")

    def replay(self, batch_size: int) -> torch.Tensor:
        """Run the graph of batch_size (a captured size) and return the hidden states it wrote,
        [batch_size, hidden]: a view of `outputs`, not a copy."""
        raise _not_written("replay")


def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
    """Exercise 07.1, the inputs: one new token per sequence, written into the static host buffer that the next
    upload copies to the device, padded to the graph that will run it (chapter 07, sections 3 and
    "4. Padding rows, and picking the graph"). Replaces DecodeCUDAGraphs.prepare_decode.

    `self` is the layer: self.graphs (the CUDAGraphRunner: max_batch_size, batch_size_for),
    self.decode_buffers (DecodeBuffers) and self.block_size.
    More sequences than the largest graph holds: the step runs eagerly, with the inputs of the layer
    below, super(DecodeCUDAGraphs, self).prepare_decode(seqs) (the bare super() works only inside
    the class).
    Otherwise, of n sequences, padded to the size the runner picks:
    - self.decode_buffers.next_host_buffer() switches to the host buffer the step may fill and returns
      its views: input_ids, positions, slot_mapping, context_lens, seq_order ([max_batch_size] each)
      and block_tables ([max_batch_size, width]), numpy int32 arrays. Write into them, nothing else.
    - Row i < n is seqs[i]: its last token id, that token's position and cache slot (chapter 02),
      its context length (seq.num_tokens, the new token included) and its block table, written with
      self.decode_buffers.write_block_tables([...]) (given: it writes only the entries that changed).
    - Rows n .. padded-1 are padding, whatever an earlier step left in them: token id 0, and they
      store nothing and attend to nothing (chapter 06, section 7).
    - seq_order[:padded]: the rows by context length, longest first, ties in row order; padding last.
    Return self._padded_inputs(n, padded) (given): StepInputs that are views of that host buffer.
    """
    raise NotImplementedError("exercise 07.1 (prepare_decode) is not written yet: fill it in, "
                              "chapters/exercises/ex07_cuda_graphs.py; read chapters/07_cuda_graphs.md, "
                              "'4. Padding rows, and picking the graph'")
