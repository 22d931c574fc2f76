"""Argument checks shared by the kernel wrappers and their references."""


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
