"""What every layer of a model is built with, beyond the model's own config: its place in the
tensor-parallel group and how its linear layers hold their weights.

One small object passed down the model's constructors (vLLM passes its VllmConfig the same way).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelContext:
    tp_rank: int = 0  # this rank (0 .. tp_size-1): which shard of each split weight it holds
    tp_size: int = 1  # ranks the model is split over; 1: the whole model here
    quant_config: object = None  # layers/quantization.py's Fp8Config for FP8 linear weights; None: the model's dtype
