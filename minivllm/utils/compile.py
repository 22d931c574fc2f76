"""torch.compile for the small elementwise ops on CUDA: RMSNorm + residual (and RoPE / per-head norm
on the torch attention backend; the Triton backend fuses those into kernels/qk_norm_rope.py, and
SiLU-and-mul has its own kernel, kernels/silu_and_mul.py).

Unfused, each is several tiny kernels (cast, square, mean, rsqrt, multiply, ...): a decode step of a
28-layer model launches over a thousand of them. Compiled, each op is one generated Triton kernel.
On the CPU (and if compilation fails) the plain PyTorch function runs; `fn.__wrapped__` is always
the plain one. The engine option `compile_small_ops` is each layer's to apply (RMSNorm, SiluAndMul
take it when the model is built): there is no process-wide switch. vLLM: vllm/compilation/.
"""
import functools
import logging

import torch

logger = logging.getLogger("minivllm")

def compile_on_cuda(fn):
    """Run `fn` through torch.compile when its first argument is a CUDA tensor."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(*args)
        except Exception as exc:  # a broken compiler stack must not break the engine
            # str(exc), not exc: a log record holding the exception would keep its traceback's
            # frames (and the model's tensors they reference) alive
            logger.warning("torch.compile of %s failed (%s); running it eagerly", fn.__name__, str(exc))
            compiled = fn
            return fn(*args)

    return wrapper
