"""Random-weight Hugging Face checkpoints (Qwen3, Qwen3-MoE, Qwen2, Llama) made offline, seeded and deterministic.

Builds the transformers model from a preset config with transformers' own initialisation (normal
std=initializer_range, RMSNorm weights 1), then saves config, safetensors, tokenizer and generation
config: a directory that minivllm and transformers both load. vLLM has no such tool; its tests use
hub checkpoints (vllm/tests/models/registry.py) and its loader is vllm/model_executor/model_loader/.

    python -m minivllm.tools.make_model --preset qwen3-0.6b --out checkpoints/qwen3-0.6b [--seed 0] [--fp8]

With quantization="fp8" (--fp8) the decoder's linear weights are written as a block-FP8 checkpoint
in the Hugging Face format of the published Qwen3-*-FP8 models: float8_e4m3fn `weight` tensors,
a float32 `weight_scale_inv` per 128 x 128 block beside each, and a "quantization_config" in
config.json; embeddings, norms and the LM head stay in `dtype`.
"""
import argparse
import inspect
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

from minivllm.tools.tokenizer import EOS_TOKEN, PAD_TOKEN, ENDOFTEXT, get_tokenizer_dir, save_tokenizer

# architectures[0] in config.json -> (config class, model class)
ARCHITECTURES = {
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
    "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM),
    "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)  # no FP8 checkpoints of these (FusedMoE has no FP8 path)
RECIPE_FILE = "make_model.json"  # how this directory was made; a re-run with the same recipe skips
MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", RECIPE_FILE)
TINY_VOCAB_SIZE = 8064  # the tokenizer's 8000 ids rounded up to a multiple of 128, as model vocabs are
QUANTIZATIONS = (None, "fp8")
FP8_BLOCK_SIZE = [128, 128]
# the checkpoint tensors an FP8 checkpoint stores in FP8: every linear layer of the decoder
_FP8_WEIGHT = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Preset:
    architecture: str
    dtype: str  # the dtype the weights are written in unless make_model is given another
    config: dict = field(default_factory=dict)  # fields of the transformers config


PRESETS = {
    # The real Qwen3-0.6B shape (596M parameters), random weights.
    "qwen3-0.6b": Preset("Qwen3ForCausalLM", "bfloat16", dict(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    # The Qwen3-8B shape (8.2B parameters), random weights: a model that tensor parallelism splits
    # over two GPUs.
    "qwen3-8b": Preset("Qwen3ForCausalLM", "bfloat16", dict(
        vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)),
    # The SmolLM2-135M-Instruct shape (the demo's real model, 135M parameters, 270 MB in bfloat16),
    # random weights: the same step time as the real checkpoint where that cannot travel (a GPU machine
    # without the package that ships it). A launch-bound regime at batch 1.
    "smollm2-135m": Preset("LlamaForCausalLM", "bfloat16", dict(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True,
        rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    # For the CPU demo: ~60 batched chat prompts in about a minute on two cores.
    "qwen3-small": Preset("Qwen3ForCausalLM", "float32", dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1536, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)),
    # For tests: a forward pass in milliseconds.
    "qwen3-tiny": Preset("Qwen3ForCausalLM", "float32", dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, intermediate_size=512, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)),
    # Llama: no q/k norms, untied head, GQA ratio 4.
    "llama-tiny": Preset("LlamaForCausalLM", "float32", dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, intermediate_size=640, tie_word_embeddings=False,
        rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5)),
    # Qwen2: biases on q, k and v, no q/k norms, tied head, GQA ratio 3 (head_dim is hidden / heads).
    "qwen2-tiny": Preset("Qwen2ForCausalLM", "float32", dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=448, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)),
    # Qwen3-MoE for CPU tests and the notebook: 8 experts, top-2, layer 2 dense among sparse ones
    # (mlp_only_layers); moe_intermediate_size 96 is no power of two (a kernel's masks must hold),
    # and halves evenly for two tensor-parallel ranks.
    "qwen3-moe-tiny": Preset("Qwen3MoeForCausalLM", "float32", dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=320, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
        tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)),
    # The real Qwen3-30B-A3B shape (30.5B parameters, 3.3B active per token: 8 of 128 experts), random
    # weights: 61 GB in bfloat16. Make it on the GPU only (--init-device cuda; the CPU's generator
    # would take hours), with >= 64 GB of free disk. One copy in host memory: the weights are drawn on
    # the GPU and moved to the host parameter by parameter (build_model's .to("cpu")), and
    # save_pretrained writes the per-expert tensors as views of the fused ones (no second copy).
    "qwen3-30b-a3b": Preset("Qwen3MoeForCausalLM", "bfloat16", dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6)),
}


def _split_spec(preset_or_overrides: str | dict) -> tuple[str, dict]:
    if isinstance(preset_or_overrides, str):
        return preset_or_overrides, {}
    overrides = dict(preset_or_overrides)
    if "preset" not in overrides:
        raise ValueError(f"overrides need a 'preset' key naming the base preset, one of {sorted(PRESETS)}")
    return overrides.pop("preset"), overrides


def _get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]


def _check_fields(config_class, overrides: dict) -> None:
    # Config classes swallow unknown keyword arguments; a typo must not pass silently.
    known = set(config_class().to_dict()) | set(inspect.signature(config_class.__init__).parameters)
    unknown = sorted(set(overrides) - known - {"rope_theta"})
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} fields: {unknown}")


def _special_token_ids() -> tuple[dict, int]:
    """The config's bos/eos/pad ids, looked up in the tokenizer, and the tokenizer's id count."""
    tokenizer = Tokenizer.from_file(str(get_tokenizer_dir() / "tokenizer.json"))
    return dict(bos_token_id=tokenizer.token_to_id(ENDOFTEXT), eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
                pad_token_id=tokenizer.token_to_id(PAD_TOKEN)), tokenizer.get_vocab_size()


def make_config(preset_or_overrides: str | dict):
    """The transformers config (Qwen3Config, Qwen3MoeConfig, Qwen2Config or LlamaConfig) of a preset,
    with overrides applied.

    Args:
        preset_or_overrides: a preset name, or a dict {"preset": name, field: value, ...}.
    """
    name, overrides = _split_spec(preset_or_overrides)
    preset = _get_preset(name)
    config_class, _ = ARCHITECTURES[preset.architecture]
    _check_fields(config_class, overrides)
    token_ids, num_tokenizer_ids = _special_token_ids()
    fields = {**preset.config, **token_ids, **overrides}
    if fields["vocab_size"] < num_tokenizer_ids:
        raise ValueError(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer's {num_tokenizer_ids} ids")
    return config_class(architectures=[preset.architecture], **fields)


def _resolve_dtype(preset_or_overrides, dtype) -> torch.dtype:
    if dtype is None:
        dtype = _get_preset(_split_spec(preset_or_overrides)[0]).dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def build_model(config, seed: int, dtype: torch.dtype, init_device: str = "cpu") -> torch.nn.Module:
    """Instantiate the transformers model with its own init, seeded, directly in `dtype`, on `init_device`.

    nn.Linear's constructor runs a kaiming init that transformers then overwrites with normal(0,
    0.02); skipping the first (no_init_weights) saves ~40%: 0.6B took ~17 s instead of ~28 s on 2 CPU cores.
    The CPU's random generator is serial, so an 8B model takes minutes there; init_device="cuda" takes
    seconds (other weights for the same seed: the CUDA generator draws other numbers).
    """
    _, model_class = ARCHITECTURES[config.architectures[0]]
    device = torch.device(init_device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leave the caller's RNG alone
        torch.manual_seed(seed)
        with no_init_weights(), device:
            model = model_class._from_config(config, dtype=dtype)
        model.init_weights()  # transformers' _init_weights on every module, then tie_weights
    return model.to("cpu")


def _recipe(preset_or_overrides, seed: int, dtype: torch.dtype, quantization: str | None = None,
            init_device: str = "cpu") -> dict:
    name, overrides = _split_spec(preset_or_overrides)
    recipe = {"preset": name, "overrides": overrides, "seed": seed, "dtype": str(dtype).removeprefix("torch."),
              "tokenizer": get_tokenizer_dir().name, "transformers": transformers.__version__}
    if quantization is not None:
        recipe["quantization"] = quantization
    if init_device != "cpu":
        recipe["init_device"] = init_device
    return recipe


def _check_quantization(quantization, preset_or_overrides):
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    architecture = _get_preset(_split_spec(preset_or_overrides)[0]).architecture
    if quantization is not None and architecture in MOE_ARCHITECTURES:
        raise ValueError(f"quantization={quantization!r} is not supported for {architecture} (minivllm's FusedMoE "
                         "has no FP8 path)")


def quantize_checkpoint_fp8(model_dir: Path) -> None:
    """Rewrite a model directory in place as a block-FP8 checkpoint (see the module docstring)."""
    from minivllm.kernels.fp8_gemm import quantize_fp8_blocks_ref

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    out = {}
    for name, tensor in tensors.items():
        if _FP8_WEIGHT.search(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks_ref(tensor, *FP8_BLOCK_SIZE)
        else:
            out[name] = tensor
    save_file(out, path, metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": FP8_BLOCK_SIZE}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_complete(model_dir: Path, recipe: dict | None = None) -> bool:
    """All files present and, when a recipe is given, made by the same recipe."""
    if not all((model_dir / name).is_file() for name in MODEL_FILES):
        return False
    return recipe is None or json.loads((model_dir / RECIPE_FILE).read_text()) == recipe


def save_per_expert(model, out: Path) -> None:
    """save_pretrained for a mixture of experts, without a second copy of the experts in memory.

    transformers >= 5 keeps each layer's experts fused (mlp.experts.gate_up_proj [E, 2N, K], gate rows
    then up rows; mlp.experts.down_proj [E, K, N]); save_pretrained writes the hub's per-expert
    tensors but first copies every gate and up half into a contiguous tensor (+40 GB of host memory
    for Qwen3-30B-A3B). Each per-expert tensor is a contiguous view (gate_up_proj[e, :N] is one block
    of memory), and safetensors writes views as they are. The files are the ones save_pretrained
    writes; with transformers 4 (experts already per expert) nothing needs splitting."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")  # "....mlp.experts."
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)  # [E, N, K] each
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith(".experts.down_proj"):
            for e, down in enumerate(tensor):  # [K, N] each
                tensors[f"{prefix}{e}.down_proj.weight"] = down
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = tensor
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def _write_model_dir(out: Path, preset_or_overrides, seed: int, dtype: torch.dtype, recipe: dict,
                     quantization: str | None, init_device: str) -> None:
    config = make_config(preset_or_overrides)
    model = build_model(config, seed, dtype, init_device)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    # safetensors, one file (MODEL_FILES) whatever the size; a tied lm_head is not written a second time
    if config.architectures[0] in MOE_ARCHITECTURES:
        save_per_expert(model, out)
    else:
        model.save_pretrained(out, max_shard_size="1000GB")
    save_tokenizer(out)
    if quantization == "fp8":
        quantize_checkpoint_fp8(out)
    (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")


def make_model(preset_or_overrides: str | dict, out_dir: str | os.PathLike, seed: int = 0,
               dtype: str | torch.dtype | None = None, quantization: str | None = None,
               init_device: str = "cpu") -> Path:
    """Write a complete Hugging Face model directory with random weights; return its path.

    Args:
        preset_or_overrides: a preset name (see PRESETS) or {"preset": name, <config field>: value}.
        out_dir: the directory to write. If it already holds this exact recipe it is left as is;
            if it holds another make_model recipe it is replaced; any other non-empty directory
            is an error (we never delete what we did not make).
        seed: seeds the initialisation; same seed, same weights.
        dtype: weight dtype; None means the preset's (bfloat16 for qwen3-0.6b, else float32).
        quantization: None, or "fp8" for a block-FP8 checkpoint (the same random weights, quantized).
        init_device: where the random weights are drawn: "cpu" (the default, the same weights on every
            machine) or "cuda" (seconds instead of minutes for 8B models; weights of that generator).
    """
    out = Path(out_dir)
    dtype = _resolve_dtype(preset_or_overrides, dtype)
    _check_quantization(quantization, preset_or_overrides)
    recipe = _recipe(preset_or_overrides, seed, dtype, quantization, init_device)
    if is_complete(out, recipe):
        return out
    if out.exists() and any(out.iterdir()) and not (out / RECIPE_FILE).is_file():
        raise FileExistsError(f"{out} is not empty and was not made by make_model; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: no reader ever sees a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is for everyone to read
    try:
        _write_model_dir(tmp, preset_or_overrides, seed, dtype, recipe, quantization, init_device)
        if out.exists() and not is_complete(out, recipe):
            shutil.rmtree(out)
        if not out.exists():
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_config_dir(preset_or_overrides: str | dict, out_dir: str | os.PathLike) -> Path:
    """A model directory without weights: config.json, generation_config.json and the tokenizer, for
    LLM(..., load_format="dummy") (random weights drawn on the device, nothing read): the shape of a
    model too large to write, e.g. Qwen3-30B-A3B's 61 GB. Rewritten on every call (a few KB)."""
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        raise FileExistsError(f"{out} holds weights; a config-only directory goes elsewhere")
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(preset_or_overrides)
    config.torch_dtype = str(_resolve_dtype(preset_or_overrides, None)).removeprefix("torch.")
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    save_tokenizer(out)
    return out


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Number of stored parameters, read from the safetensors headers (tied weights count once)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="weight dtype (default: the preset's)")
    parser.add_argument("--fp8", action="store_true",
                        help="write a block-FP8 checkpoint (quantization_config quant_method fp8, 128 x 128 blocks)")
    parser.add_argument("--init-device", default="cpu", choices=["cpu", "cuda"],
                        help="where to draw the random weights (cuda: seconds instead of minutes for 8B models)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    quantization = "fp8" if args.fp8 else None
    existed = is_complete(out, _recipe(args.preset, args.seed, _resolve_dtype(args.preset, args.dtype), quantization,
                                       args.init_device))
    make_model(args.preset, out, seed=args.seed, dtype=args.dtype, quantization=quantization,
               init_device=args.init_device)
    verb = "already complete, skipped" if existed else "wrote"
    print(f"{verb}: {out.resolve()} ({args.preset}, seed {args.seed}, {count_parameters(out):,} parameters)")


if __name__ == "__main__":
    main()
