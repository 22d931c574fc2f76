"""RMSNorm, with the residual add fused in (as vLLM's fused_add_rms_norm).

    y = x / sqrt(mean(x^2) + eps) * weight          computed in float32, returned in x's dtype
vLLM: vllm/model_executor/layers/layernorm.py.
"""
import torch
from torch import nn

from minivllm.utils.compile import compile_on_cuda


@compile_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@compile_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm.__wrapped__(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, compile_small_ops: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # the engine option: torch.compile on CUDA (utils/compile.py), or the plain ops
        self._rms_norm = rms_norm if compile_small_ops else rms_norm.__wrapped__
        self._add_rms_norm = add_rms_norm if compile_small_ops else add_rms_norm.__wrapped__

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: returns norm(x). With it: returns (norm(x + residual), x + residual),
        the second being the residual stream for the next layer."""
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._add_rms_norm(x, residual, self.weight, self.eps)
