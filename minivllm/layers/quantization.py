"""FP8 weights (W8A8): how a linear layer holds and multiplies float8_e4m3fn weights.

Every linear layer asks its `quant_method` to create its parameters, to convert them once the
checkpoint is loaded, and to compute y = x W^T. Two FP8 methods, both with activations quantized
on the fly (dynamic scales):

    Fp8LinearMethod       bf16/fp16/fp32 checkpoint, LLM(..., quantization="fp8"): each weight is
                          quantized after loading, one scale per output channel; activations one
                          scale per token. GEMM: torch._scaled_mm (cuBLASLt) on CUDA.
    Fp8BlockLinearMethod  an FP8 checkpoint (config.json "quantization_config": quant_method "fp8",
                          weight_block_size [128, 128]): fp8 `weight` + `weight_scale_inv` (one
                          float32 per 128 x 128 block) load as they are; activations one scale per
                          token and 128 columns. GEMM: the Triton kernel kernels/fp8_gemm.py.

On the CPU both run the dequantize-then-matmul references of kernels/fp8_gemm.py (the same codes
and scales, so the same numerics up to float32 summation order).
vLLM: vllm/model_executor/layers/quantization/fp8.py (Fp8Config, Fp8LinearMethod).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.fp8_gemm import (
    per_token_group_quant_fp8, per_token_group_quant_fp8_ref, quantize_fp8_blocks_ref, scaled_mm_per_channel,
    w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref,
)
from minivllm.kernels.quant_fp8 import FP8_DTYPE

QUANTIZATION_METHODS = ("fp8",)  # vLLM's names for LLM(..., quantization=...)
SUPPORTED_BLOCK_SIZE = (128, 128)  # [rows (output features), columns (input features)] per weight scale
# Checkpoint modules that are never quantized here anyway (embeddings and the LM head stay in the
# model's dtype), so a checkpoint may list them in modules_to_not_convert.
_NEVER_QUANTIZED = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class Fp8Config:
    """weight_block_size None: per-output-channel scales computed at load time (a bf16 checkpoint);
    (128, 128): a block-FP8 checkpoint's weight_scale_inv."""
    weight_block_size: tuple[int, int] | None = None

    @property
    def is_checkpoint_fp8(self) -> bool:
        return self.weight_block_size is not None

    def get_linear_method(self):
        return Fp8BlockLinearMethod(self.weight_block_size) if self.is_checkpoint_fp8 else Fp8LinearMethod()


def get_quant_config(quantization: str | None, hf_config) -> Fp8Config | None:
    """The FP8 config for the `quantization` option and the checkpoint's own quantization_config.

    None + plain checkpoint: unquantized. "fp8" + plain checkpoint: quantize at load time. An FP8
    checkpoint loads as FP8 whether or not quantization="fp8" is given (as in vLLM). Anything else
    (another method, block size, activation scheme) is a ValueError saying what is supported."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {quantization!r}")
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint is None:
        return Fp8Config() if quantization == "fp8" else None
    if not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()
    method = checkpoint.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the checkpoint is quantized with quant_method={method!r}; minivllm loads only block-wise "
                         f"'fp8' checkpoints (weight_block_size {list(SUPPORTED_BLOCK_SIZE)})")
    block = checkpoint.get("weight_block_size")
    if block is None or tuple(block) != SUPPORTED_BLOCK_SIZE:
        raise ValueError(f"FP8 checkpoint with weight_block_size={block!r}: minivllm loads only "
                         f"{list(SUPPORTED_BLOCK_SIZE)} blocks (per-tensor FP8 checkpoints are not supported)")
    if checkpoint.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 checkpoint with activation_scheme={checkpoint['activation_scheme']!r}: only "
                         f"'dynamic' (per-token-group activation scales computed at run time) is supported")
    if checkpoint.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint with fmt={checkpoint['fmt']!r}: only 'e4m3' (float8_e4m3fn) is supported")
    skipped = list(checkpoint.get("modules_to_not_convert") or []) + list(checkpoint.get("ignored_layers") or [])
    unsupported = [m for m in skipped if m.split(".")[-1] not in _NEVER_QUANTIZED]
    if unsupported:
        raise ValueError(f"FP8 checkpoint keeps {unsupported[:4]} unquantized (modules_to_not_convert); minivllm "
                         f"quantizes every linear layer of the decoder and supports only {_NEVER_QUANTIZED} there")
    return Fp8Config(weight_block_size=SUPPORTED_BLOCK_SIZE)


def _parameter(data: torch.Tensor, loader) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    return param


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [num_tokens, K]; a view for the usual contiguous activations


class UnquantizedLinearMethod:
    """The weight in the model's dtype; y = x W^T (+ b)."""

    def create_weights(self, layer: nn.Module, output_partition_sizes: list[int]):
        layer.weight = _parameter(torch.empty(layer.output_size, layer.input_size), layer.weight_loader)

    def process_weights_after_loading(self, layer: nn.Module):
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Loads the checkpoint's weight in the model's dtype, then replaces it with its FP8 codes and
    `weight_scale` [N, 1] float32 (one per output channel of this rank's shard)."""

    def process_weights_after_loading(self, layer: nn.Module):
        codes, scales = quantize_fp8_blocks_ref(layer.weight.data, 1, layer.input_size)  # [N, K], [N, 1]
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales, requires_grad=False)

    def apply(self, layer, x, bias):
        x2d, K = _as_2d(x), layer.input_size
        if x.is_cuda:
            codes, scales = per_token_group_quant_fp8(x2d, group_size=K)  # [M, K], [M, 1]
            y = scaled_mm_per_channel(codes, scales, layer.weight, layer.weight_scale, output_dtype=x.dtype)
        else:
            codes, scales = per_token_group_quant_fp8_ref(x2d, group_size=K)
            y = w8a8_block_fp8_matmul_ref(codes, scales, layer.weight, layer.weight_scale, (1, K), x.dtype)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class Fp8BlockLinearMethod:
    """An FP8 checkpoint's layer: `weight` [N, K] float8_e4m3fn and `weight_scale_inv`
    [ceil(N/128), ceil(K/128)] float32 (the multiplier that dequantizes a block, despite its name),
    both this rank's shard. Tensor parallelism and packing cut the weight at rows or columns that
    must be block boundaries, so that each scale belongs to one rank and one packed part:

        qkv_proj weight rows:  | q (rank's heads) | k | v |      each part a multiple of 128 rows
        weight_scale_inv rows: | q / 128          | k / 128 | v / 128 |
    """

    def __init__(self, block_size: tuple[int, int]):
        self.block_size = tuple(block_size)

    def _check_shapes(self, layer, output_partition_sizes):
        """vLLM's validate_block_quant_shapes: a cut inside a block has no scale of its own."""
        block_n, block_k = self.block_size
        rows_cut = len(output_partition_sizes) > 1 or (layer.tp_size > 1 and layer.tp_dim == 0)
        if rows_cut and any(size % block_n for size in output_partition_sizes):
            raise ValueError(f"{type(layer).__name__}: block-FP8 needs every output part of a rank to be a "
                             f"multiple of {block_n} rows, got {output_partition_sizes} (tensor_parallel_size="
                             f"{layer.tp_size}); use a smaller tensor_parallel_size")
        if layer.tp_size > 1 and layer.tp_dim == 1 and layer.input_size % block_k:
            raise ValueError(f"{type(layer).__name__}: block-FP8 needs each rank's {layer.input_size} input "
                             f"columns to be a multiple of {block_k} (tensor_parallel_size={layer.tp_size})")

    def create_weights(self, layer, output_partition_sizes):
        self._check_shapes(layer, output_partition_sizes)
        block_n, block_k = self.block_size
        N, K = layer.output_size, layer.input_size
        layer.weight = _parameter(torch.empty(N, K, dtype=FP8_DTYPE), layer.weight_loader)
        scale = torch.empty(-(-N // block_n), -(-K // block_k), dtype=torch.float32)
        layer.weight_scale_inv = _parameter(scale, layer.weight_loader)
        layer.weight_scale_inv.block_size = self.block_size  # the loaders count its rows in blocks

    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x, bias):
        x2d, (block_n, block_k) = _as_2d(x), self.block_size
        if x.is_cuda:
            codes, scales = per_token_group_quant_fp8(x2d, group_size=block_k)  # [M, K], [M, K / 128]
            y = w8a8_block_fp8_matmul(codes, scales, layer.weight, layer.weight_scale_inv, self.block_size, x.dtype)
        else:
            codes, scales = per_token_group_quant_fp8_ref(x2d, group_size=block_k)
            y = w8a8_block_fp8_matmul_ref(codes, scales, layer.weight, layer.weight_scale_inv, self.block_size,
                                          x.dtype)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
