"""Argument checks and device queries shared by the attention kernels and their references.

vLLM keeps the same kind of glue in vllm/attention/ops/ (e.g. the shape checks of its wrappers).
"""
import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

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


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it in the stream finishes, and waits (griddepcontrol.wait, `tl.extra.cuda.gdc_wait`)
# before its first memory access; it lets the next one start as soon as every program of its own has
# begun (`gdc_launch_dependents`). Between two small kernels of a decode step that hides most of the
# launch gap, inside CUDA graphs too. Kernels that take part have a USE_PDL constexpr and wait at their
# top, so a dependent never reads what its predecessor has not finished writing; any other kernel
# (torch's, cuBLAS's) runs as usual and the chain simply pauses there.
_dependent_launches = contextvars.ContextVar("minivllm_dependent_launches", default=False)


@contextlib.contextmanager
def dependent_launches(enabled: bool = True):
    """Within this context, the kernels that support it launch with programmatic dependent launch."""
    token = _dependent_launches.set(enabled)
    try:
        yield
    finally:
        _dependent_launches.reset(token)


def use_pdl(device) -> bool:
    """Launch a kernel on `device` now with programmatic dependent launch (the kernel's USE_PDL and
    Triton's launch_pdl option)? Only inside `dependent_launches` and on a compiled CUDA kernel."""
    return _dependent_launches.get() and device.type == "cuda" and not is_interpreter()


def pdl_launch_args(device) -> dict:
    """The launch keywords of a kernel with a USE_PDL constexpr: programmatic dependent launch on or off."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(device) else {}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """A participating kernel's first statement: under programmatic dependent launch, wait until the
    kernel before has finished and its writes are visible, then let the next kernel begin launching."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_supported(device) -> str | None:
    """Why programmatic dependent launch cannot run on `device`, or None when it can."""
    if device.type != "cuda" or is_interpreter():
        return "it needs a CUDA GPU (compiled kernels, not the Triton interpreter)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or later (Hopper), this GPU has {major}.x"
    return None


def check_last_dim_contiguous(**tensors):
    for name, t in tensors.items():
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim (stride {t.stride()})"
