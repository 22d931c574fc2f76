"""Qwen3: the Llama-family decoder plus a per-head RMSNorm on queries and keys before RoPE.

vLLM: vllm/model_executor/models/qwen3.py.
"""
from minivllm.models.transformer import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
