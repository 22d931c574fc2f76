"""The model registry: config.json's `architectures` entry -> minivllm model class.

vLLM: vllm/model_executor/models/registry.py.
"""
import importlib

# architecture name -> (module, class); imported only when asked for
_MODELS = {
    "Qwen3ForCausalLM": ("minivllm.models.qwen3", "Qwen3ForCausalLM"),
    "LlamaForCausalLM": ("minivllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("minivllm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("minivllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config):
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architecture {architectures}; minivllm supports {supported_architectures()}")
