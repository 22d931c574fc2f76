"""Argument checks and device queries shared by the attention kernels and their references.

vLLM keeps the same kind of glue in vllm/attention/ops/ (e.g. the shape checks of its wrappers).
"""
import functools
import os

import torch

LOG2_E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2_E)


def reject_unsupported(**kwargs):
    """Raise if a flash-attn argument we do not implement is set to a non-default value.

    Each keyword maps to (value, default).
    """
    for name, (value, default) in kwargs.items():
        if value != default:
            raise NotImplementedError(
                f"minivllm.kernels does not support {name}={value!r} (only the default {default!r})"
            )


def default_scale(head_dim, softmax_scale):
    return head_dim**-0.5 if softmax_scale is None else float(softmax_scale)


def is_interpreter():
    """True under TRITON_INTERPRET=1 (kernels then run in numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def num_sms(device_index):
    """Streaming multiprocessors of a CUDA device (132 on an H200), read once and cached so that
    wrappers can size their grids without touching the device inside a CUDA-graph capture."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_last_dim_contiguous(**tensors):
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim (stride {t.stride()})"


_counters: dict = {}
MAX_COUNTERS = 1 << 16  # per device and purpose: output tiles of a split-K GEMV, (sequence, KV head) pairs of decode


def zeroed_counters(device, purpose: str) -> torch.Tensor:
    """MAX_COUNTERS int32 counters of `device` for one kernel (`purpose`), zeroed once: a kernel whose
    programs count themselves done on them leaves each back at zero (its last program resets it), so the
    next call, or the next replay of a CUDA graph that captured one, finds them zeroed. Allocated outside
    any capture: the first call on a device must run eagerly (the engine's warm-up does)."""
    key = (device, purpose)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the first {purpose} on a device ran inside a CUDA-graph capture: run it once before "
                               "capturing (the engine's warm-up does), so its counters live outside the graph")
        _counters[key] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]
