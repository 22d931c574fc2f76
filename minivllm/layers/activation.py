"""SwiGLU's gate: silu(gate) * up, over the packed [gate | up] output of the MLP's first matmul.

Plain PyTorch ops here; the engine's fused-ops layer runs it as one Triton kernel on CUDA
(kernels/silu_and_mul.py, via minivllm/engine/fused_ops.py).
vLLM: vllm/model_executor/layers/activation.py (SiluAndMul).
"""
import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.silu_and_mul_fn = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul_fn(x)
