"""Argument checks and small Triton helpers shared by the attention kernels and their references.

vLLM keeps the same kind of glue in vllm/attention/ops/ (e.g. the shape checks of its wrappers).
"""
import functools
import os

import torch
import triton
import triton.language as tl


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


@triton.jit
def load_rows(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, D_MASK: tl.constexpr):
    """Load a [rows, head_dim] tile, masking only what can be out of range.

    Unmasked loads of full tiles let Triton issue wide, unpredicated copies: a mask is added only
    for the ragged edge of a sequence (ROW_MASK) or a padded head_dim such as 80 (D_MASK).
    """
    if ROW_MASK:
        if D_MASK:
            tile = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if D_MASK:
            tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile
