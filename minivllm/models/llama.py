"""Llama (and SmolLM2, which is a small Llama): the shared decoder with no q/k norms.

vLLM: vllm/model_executor/models/llama.py.
"""
from minivllm.models.transformer import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
