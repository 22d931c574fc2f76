"""The loader's error cases: each failure names what is wrong."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from minivllm.models.loader import build_model

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture()
def model_dir(tmp_path):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path)
    return tmp_path


def _rewrite_weights(model_dir, edit):
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_loads_every_weight_from_the_file(model_dir):
    """Every parameter equals the file's tensor; packed ones are the file's shards stacked in order."""
    model = build_model(str(model_dir))
    file = load_file(os.path.join(model_dir, "model.safetensors"))
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    used = set()
    for name, param in model.named_parameters():
        parts = packed.get(name.split(".")[-2], [name.split(".")[-2]])
        names = [name.replace(f".{name.split('.')[-2]}.", f".{part}.") for part in parts]
        used.update(names)
        expected = torch.cat([file[n] for n in names])
        assert torch.equal(param.detach(), expected), name
    assert used == set(file)  # and every tensor of the file went somewhere


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named(model_dir, bad):
    def poison(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = bad

    _rewrite_weights(model_dir, poison)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' in model.safetensors "
                                         r"has 1 NaN/Inf values"):
        build_model(str(model_dir))


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_model(str(tmp_path))


def test_missing_safetensors(model_dir):
    os.remove(os.path.join(model_dir, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        build_model(str(model_dir))


def test_missing_tensor_is_named(model_dir):
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.0.self_attn.k_proj.weight'\]"):
        build_model(str(model_dir))


def test_missing_lm_head_when_untied(model_dir):
    _rewrite_weights(model_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['lm_head.weight'\]"):
        build_model(str(model_dir))


def test_unexpected_tensor_is_named(model_dir):
    _rewrite_weights(model_dir, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.0.mystery.weight'"):
        build_model(str(model_dir))


def test_shape_mismatch_is_named(model_dir):
    _rewrite_weights(model_dir, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(47, 32)}))
    with pytest.raises(ValueError, match=r"shape mismatch for model.layers.0.mlp.up_proj.weight: checkpoint has "
                                         r"\(47, 32\), the model expects \(48, 32\)"):
        build_model(str(model_dir))


def test_unknown_architecture_lists_supported(model_dir):
    config_path = os.path.join(model_dir, "config.json")
    config = json.load(open(config_path))
    config["architectures"] = ["MistralForCausalLM"]
    config["model_type"] = "mistral"
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['MistralForCausalLM'\]; "
                                         r"minivllm supports \['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', "
                                         r"'Qwen3MoeForCausalLM'\]"):
        build_model(str(model_dir))


# ---- load_format="dummy": random weights, no checkpoint read ----------------------------------------

def test_dummy_weights_need_no_checkpoint_and_repeat(tmp_path):
    """A config-only directory (make_config_dir) runs: matrices N(0, initializer_range), norms 1; the
    same seed draws the same weights, so two engines give the same greedy tokens."""
    from minivllm import LLM, SamplingParams
    from minivllm.tools.make_model import make_config_dir

    model_dir = make_config_dir("qwen3-moe-tiny", tmp_path / "moe")
    assert not list(model_dir.glob("*.safetensors"))
    model = build_model(str(model_dir), load_format="dummy")
    params = dict(model.named_parameters())
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in params.items() if n.endswith("norm.weight"))
    experts = params["model.layers.0.mlp.experts.w13_weight"]
    assert abs(experts.std().item() - 0.02) < 0.002 and abs(experts.mean().item()) < 0.002
    params_again = dict(build_model(str(model_dir), load_format="dummy").named_parameters())
    assert all(torch.equal(p, params_again[n]) for n, p in params.items())
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy_tokens():  # one engine at a time: on a GPU each sizes its KV cache from the free memory
        llm = LLM(str(model_dir), load_format="dummy", max_model_len=64)
        try:
            return llm.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        finally:
            llm.shutdown()

    first = greedy_tokens()
    assert first == greedy_tokens() and len(first) == 6


def test_dummy_weights_refuse_an_fp8_checkpoint_and_an_unknown_format(tmp_path):
    from minivllm import LLM
    from minivllm.tools.make_model import make_config_dir, make_model

    with pytest.raises(ValueError, match=r"load_format must be one of \('auto', 'dummy'\)"):
        LLM(str(make_config_dir("qwen3-tiny", tmp_path / "cfg")), load_format="random")
    fp8_dir = make_model("qwen3-tiny", tmp_path / "fp8", quantization="fp8")
    with pytest.raises(ValueError, match="cannot draw FP8 weights"):
        build_model(str(fp8_dir), load_format="dummy")
    with pytest.raises(FileExistsError, match="holds weights"):
        make_config_dir("qwen3-tiny", fp8_dir)
