"""Programmatic dependent launch: a ModelRunner layer under which the model's Triton kernels (the
small-batch GEMVs, q/k-norm + RoPE + KV store, paged decode and its merge) launch so that each may
start while the kernel before it in the stream is finishing.

    without:   [ kernel A ........ ]  gap  [ kernel B ........ ]  gap  [ kernel C ...
    with:      [ kernel A ........ ]
                              [ B launches, waits ][ B runs .. ]
                                                   [ C launches, waits ][ C runs ...

Each participating kernel begins with `pdl_prologue` (kernels/_common.py): griddepcontrol.wait (until
the kernel before has finished and its writes are visible), then launch_dependents (the next kernel
may start launching). A decode step at batch 1 is a chain of about 200 small kernels whose launch
gaps, a few microseconds each even inside a CUDA graph, add up to a large part of the step; the
graph keeps the launch attribute, so replays overlap as eager steps do. Kernels that do not take
part (torch's, cuBLAS's) launch as usual: the chain waits there, as without this layer.

Hopper (sm_90) or later; `dependent_launch=True` (off by default until its H200 measurement says it
pays: benchmarks/bench_latency.py). vLLM: its FlashInfer and CUTLASS kernels take the same launch
attribute (`enable_pdl`); Triton's tutorial 11 shows the two instructions.
"""
import functools

from minivllm.kernels._common import dependent_launches


def launch_dependently(model):
    """Run every forward of `model` (eager, or while a CUDA graph captures it) under dependent launches."""
    forward = model.forward

    @functools.wraps(forward)
    def forward_with_dependent_launches(*args, **kwargs):
        with dependent_launches():
            return forward(*args, **kwargs)

    model.forward = forward_with_dependent_launches
    return model


class DependentLaunch:
    """ModelRunner layer: the model's forward with programmatic dependent launch (`load_model`)."""

    def load_model(self):
        return launch_dependently(super().load_model())
