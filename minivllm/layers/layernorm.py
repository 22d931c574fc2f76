"""RMSNorm, with the residual add fused in (as vLLM's fused_add_rms_norm).

    y = x / sqrt(mean(x^2) + eps) * weight          computed in float32, returned in x's dtype
vLLM: vllm/model_executor/layers/layernorm.py.
"""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: returns norm(x). With it: returns (norm(x + residual), x + residual),
        the second being the residual stream for the next layer."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
