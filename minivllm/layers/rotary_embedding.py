"""Rotary position embedding (RoPE), the "rotate half" (GPT-NeoX) layout used by Llama and Qwen.

Each pair (x[i], x[i + d/2]) of a head is rotated by the angle position * theta^(-2i/d). The
cos/sin table for every position is computed once (RotaryEmbedding, shared by every layer) and
`apply_rotary` rotates q and k with it. (The engine's fused-ops layer runs it inside one kernel
with the q/k norms and the KV-cache store: kernels/qk_norm_rope.py.)
vLLM: vllm/model_executor/layers/rotary_embedding.py.
"""
import torch
from torch import nn


def rope_theta_of(hf_config) -> float:
    """rope_theta from a transformers 4 (`rope_theta`) or 5 (`rope_parameters`) config."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise ValueError("the model config has neither rope_theta nor rope_parameters['rope_theta']")
    return float(theta)


def check_rope_scaling(hf_config):
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported (only plain RoPE)")


class RotaryEmbedding(nn.Module):
    """The cos/sin table, cos_sin_cache: [max_position, head_dim] float32, cos | sin of each angle;
    forward(positions, q, k) rotates q and k (`apply_rotary_fn`, which the fused-ops layer may compile)."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_position, d/2]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.apply_rotary_fn = apply_rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.apply_rotary_fn(positions, q, k, self.cos_sin_cache)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary(positions, q, k, cos_sin_cache):
    """positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads,
    head_dim]; cos_sin_cache: RotaryEmbedding's table. Returns the rotated q and k."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, d/2] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
