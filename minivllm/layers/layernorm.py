"""RMSNorm, with the residual add fused in (as vLLM's fused_add_rms_norm).

    y = x / sqrt(mean(x^2) + eps) * weight          computed in float32, returned in x's dtype
vLLM: vllm/model_executor/layers/layernorm.py.
"""
import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    """`rms_norm_fn` / `add_rms_norm_fn` are the plain ops above; the engine's fused-ops layer may
    give them compiled versions (minivllm/engine/fused_ops.py)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.rms_norm_fn, self.add_rms_norm_fn = rms_norm, add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: returns norm(x). With it: returns (norm(x + residual), x + residual),
        the second being the residual stream for the next layer."""
        if residual is None:
            return self.rms_norm_fn(x, self.weight, self.eps)
        return self.add_rms_norm_fn(x, residual, self.weight, self.eps)
