"""SwiGLU's gate: silu(gate) * up, over the packed [gate | up] output of the MLP's first matmul.

vLLM: vllm/model_executor/layers/activation.py (SiluAndMul).
"""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.utils.compile import compile_on_cuda


@compile_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # x: [num_tokens, 2 * intermediate]
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
