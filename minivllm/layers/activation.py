"""SwiGLU's gate: silu(gate) * up, over the packed [gate | up] output of the MLP's first matmul.

On CUDA it runs as one hand-written Triton kernel (kernels/silu_and_mul.py); on the CPU, or with the
engine's `compile_small_ops` off, as plain PyTorch ops.
vLLM: vllm/model_executor/layers/activation.py (SiluAndMul).
"""
import torch
import torch.nn.functional as F
from torch import nn

import minivllm.utils.compile as small_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]."""
    if x.is_cuda and small_ops._enabled:  # the engine's compile_small_ops (set_compile_enabled)
        # Imported here, as attention.py does: minivllm.kernels imports triton, and the CPU path
        # (and importing the layers) should not need it. A cached import costs well under 1 us.
        from minivllm.kernels import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)  # x: [num_tokens, 2 * intermediate]
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
