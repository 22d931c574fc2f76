"""Hand-written Triton kernels (attention, sampling, activations, small-batch GEMV, FP8 GEMM, fused MoE), importable as `minivllm.kernels`.

Drop-in for flash-attn: the same function names, positional arguments and keyword names.

    from minivllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache

Imports inside this folder are relative: with a checkout on sys.path, transformers probes a
top-level `kernels` package, and this folder must import cleanly under that name too (README, Layout).

Each kernel file keeps its naive PyTorch reference beside it (`*_ref`, same signature); the
engine's `torch` attention backend runs those references.
"""
# A checkout on sys.path makes this folder importable as the top-level `kernels`, which is the name
# of the hub package transformers imports (a dependency of transformers >= 5.25). Under that name,
# hand the import to the hub package when one is installed; without one, import cleanly as ourselves.
from ._shadow import hand_over_to_the_hub_package

if __name__ != "kernels" or not hand_over_to_the_hub_package():
    from .fp8_gemm import (
        dequantize_fp8_blocks_ref, per_token_group_quant_fp8, per_token_group_quant_fp8_ref, quantize_fp8_blocks_ref,
        scaled_mm_per_channel, w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref,
    )
    from .flash_attn_varlen import flash_attn_varlen_func, flash_attn_varlen_ref
    from .gemv import GemvConfig, gemv, gemv_ref
    from .fused_moe import (MoEConfig, SmallMoEConfig, fused_moe, fused_moe_ref, moe_align_block_size,
                            moe_align_block_size_ref)
    from .paged_decode import flash_attn_with_kvcache, flash_attn_with_kvcache_ref
    from .qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_ref
    from .sampling import gumbel_noise, sample_tokens, sample_tokens_ref
    from .silu_and_mul import silu_and_mul, silu_and_mul_ref
    from .store_kvcache import store_kvcache, store_kvcache_ref

__all__ = [
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "store_kvcache",
    "flash_attn_varlen_ref",
    "flash_attn_with_kvcache_ref",
    "store_kvcache_ref",
    "qk_norm_rope_store",
    "qk_norm_rope_store_ref",
    "sample_tokens",
    "sample_tokens_ref",
    "gumbel_noise",
    "silu_and_mul",
    "silu_and_mul_ref",
    "gemv",
    "gemv_ref",
    "GemvConfig",
    "w8a8_block_fp8_matmul",
    "w8a8_block_fp8_matmul_ref",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "quantize_fp8_blocks_ref",
    "dequantize_fp8_blocks_ref",
    "scaled_mm_per_channel",
    "fused_moe",
    "fused_moe_ref",
    "moe_align_block_size",
    "moe_align_block_size_ref",
    "MoEConfig",
    "SmallMoEConfig",
]
