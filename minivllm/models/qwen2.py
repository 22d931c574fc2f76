"""Qwen2 (and Qwen2.5): the Llama-family decoder with biases on the q, k and v projections (none on
o_proj) and no q/k norms. Sliding-window attention (use_sliding_window) is refused.

vLLM: vllm/model_executor/models/qwen2.py.
"""
from minivllm.layers.context import ModelContext
from minivllm.models.transformer import DecoderForCausalLM, check_no_sliding_window


class Qwen2ForCausalLM(DecoderForCausalLM):
    qk_norm = False
    qkv_bias = True

    def __init__(self, config, ctx: ModelContext = ModelContext()):
        check_no_sliding_window(config)
        super().__init__(config, ctx)
