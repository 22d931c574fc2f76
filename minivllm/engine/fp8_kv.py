"""The FP8 KV cache: K and V stored as e4m3 codes under one scale per layer and tensor.

    cache element = code of (x / scale), saturated to +-448       half the bytes of bf16
    readers recover x ~= code * scale in registers                (kernels/quant_fp8.py)

The scales are 1.0 (vLLM's default), or with calculate_kv_scales each layer's first prefill sets
them from its own K and V (amax / 448): that step's attention first stores K and V once more under
the new scales, over the codes the store wrote under 1.0. Every store and attention kernel takes
the layer's k_scale / v_scale tensors (updated in place, so captured CUDA graphs read the current
values). `Fp8KVCache` is the ModelRunner layer.
vLLM: vllm/attention/layer.py (calculate_kv_scales), csrc/cache_kernels.cu (kv_cache_dtype paths).
"""
import torch

from minivllm.kernels.quant_fp8 import FP8_DTYPE, kv_scale_from_amax


class ScaleCalibration:
    """An attention backend for one layer until its first prefill: set the scales from that step's
    K and V, store them again under those scales, attend, then hand the layer back its backend."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def attend(self, layer, q, k, v, meta):
        if meta.is_prefill:
            layer.k_scale.copy_(kv_scale_from_amax(k))
            layer.v_scale.copy_(kv_scale_from_amax(v))
            self.inner.store(layer, k, v, meta)
            layer.backend = self.inner
        return self.inner.attend(layer, q, k, v, meta)


class Fp8KVCache:
    """ModelRunner layer (hooks: cache_dtype, allocate_kv_cache, __init__, shutdown)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.calculate_kv_scales:  # after every warm-up and capture: real prompts only
            for layer in self.attention_layers:
                layer.backend = ScaleCalibration(layer.backend)

    @property
    def cache_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        self.kv_scales = torch.ones(2, len(self.attention_layers), 1, dtype=torch.float32, device=self.device)
        for i, layer in enumerate(self.attention_layers):  # [1] float32 each: stored value = x / scale
            layer.k_scale, layer.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]

    def shutdown(self):
        if self.model is not None:
            for layer in self.attention_layers:
                layer.k_scale = layer.v_scale = None
            self.kv_scales = None
        super().shutdown()
