"""SwiGLU's gate: silu(gate) * up, over the packed [gate | up] output of the MLP's first matmul.

On CUDA it runs as one hand-written Triton kernel (kernels/silu_and_mul.py); on the CPU, or with the
engine's `compile_small_ops` off, as plain PyTorch ops.
vLLM: vllm/model_executor/layers/activation.py (SiluAndMul).
"""
import torch
import torch.nn.functional as F
from torch import nn



def silu_and_mul(x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]; use_kernel=False: plain ops."""
    if x.is_cuda and use_kernel:
        # Imported here, as attention.py does: minivllm.kernels imports triton, and the CPU path
        # (and importing the layers) should not need it. A cached import costs well under 1 us.
        from minivllm.kernels import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)  # x: [num_tokens, 2 * intermediate]
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self, compile_small_ops: bool = True):
        super().__init__()
        self.compile_small_ops = compile_small_ops  # the engine option: False runs plain ops on CUDA too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.compile_small_ops)
