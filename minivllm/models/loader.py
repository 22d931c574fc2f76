"""Loading a Hugging Face model directory (config.json + *.safetensors) into a minivllm model.

Checkpoint tensors are routed by name: q/k/v_proj go into the packed qkv_proj, gate/up_proj into
gate_up_proj (`packed_modules_mapping`), the experts' tensors of a mixture of experts into its
FusedMoE's packed w13/w2 (`expert_params_mapping`, models with experts only), everything else by its
own name, each through its parameter's `weight_loader`. Anything missing, unexpected, mis-shaped or
not finite (NaN/Inf) is an error naming the tensor.
Under tensor parallelism a loader receives a `CheckpointSlice`: its `narrow` reads only the rows or
columns this rank keeps from the file, so no rank reads the whole checkpoint.
An FP8 checkpoint's `weight_scale_inv` tensors route like their weights (q_proj.weight_scale_inv
into qkv_proj.weight_scale_inv); after loading, each linear layer's quant_method converts its
weights (quantization="fp8" on a bf16 checkpoint quantizes them here).
vLLM: vllm/model_executor/model_loader/default_loader.py and model_loader/__init__.py (get_model).
"""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

from minivllm.layers.context import ModelContext
from minivllm.layers.fused_moe import ExpertWeight

# Tensors some checkpoints carry that no model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(model_dir: str):
    """The transformers config of a local model directory (never touches the network)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"no config.json in {model_dir!r}: not a Hugging Face model directory")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    return files


class CheckpointSlice:
    """A checkpoint tensor not read yet (safetensors' `get_slice`): `narrow(dim, start, length)` reads
    only that slice, `load()` the whole tensor. It has the `shape`/`dim`/`narrow` a weight_loader uses."""

    def __init__(self, safe_slice, name: str, path: str):
        self._slice, self.name, self.path = safe_slice, name, path
        self.shape = torch.Size(safe_slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return _check_finite(self._slice[tuple(index)], self.name, self.path)

    def load(self) -> torch.Tensor:
        return _check_finite(self._slice[:], self.name, self.path)


def _default_weight_loader(param: nn.Parameter, loaded, name: str = ""):
    if isinstance(loaded, CheckpointSlice):
        loaded = loaded.load()
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def _route(name: str, packed_modules_mapping: dict, expert_params_mapping: dict) -> tuple[str, object]:
    """Checkpoint tensor name -> (our parameter name, shard id or None); for an expert's tensor the
    shard is its ExpertWeight (which expert, which shard: layers/fused_moe.py)."""
    start = name.find(".experts.")
    expert = expert_params_mapping.get(name[start + 1:]) if start >= 0 else None
    if expert is not None:
        return name[:start + 1] + expert.param_name, expert
    for fragment, (packed, shard_id) in packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard_id
    return name, None


def _load_tensor(param: nn.Parameter, tensor, name: str, shard_id) -> tuple:
    """Hand one checkpoint tensor to its parameter's weight_loader; return the pieces of the
    parameter it filled (its shard id, or an experts' parameter's (expert_id, shard_id) pairs)."""
    loader = getattr(param, "weight_loader", _default_weight_loader)
    if isinstance(shard_id, ExpertWeight):
        loader(param, tensor, name=name, expert_id=shard_id.expert_id, shard_id=shard_id.shard_id)
        return shard_id.fills
    if shard_id is None:
        loader(param, tensor, name=name)
    else:
        loader(param, tensor, shard_id, name=name)
    return (shard_id,)


def load_model(model: nn.Module, model_dir: str, sharded: bool = False):
    """Copy every tensor of `model_dir`'s safetensors files into `model`'s parameters, checked.

    sharded: the model is one tensor-parallel rank's; hand the loaders lazy slices (CheckpointSlice).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_params_mapping", {})  # layers/fused_moe.py's make_expert_params_mapping
    # (parameter, shard) pairs still waiting for data; a packed parameter needs each of its shards, an
    # experts' parameter each (expert_id, shard_id)
    expected = {(n, s) for n in params for s in _shards_of(n, packed, experts)}
    tied = getattr(model, "tie_word_embeddings", False)
    if tied:
        expected.discard(("lm_head.weight", None))
    with torch.no_grad():
        for path in safetensors_files(model_dir):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    param_name, shard_id = _route(name, packed, experts)
                    if param_name not in params:
                        raise ValueError(f"unexpected tensor {name!r} in {os.path.basename(path)}: "
                                         f"the model has no parameter {param_name!r}")
                    if sharded:
                        tensor = CheckpointSlice(f.get_slice(name), name, path)
                    else:
                        tensor = f.get_tensor(name)
                        _check_finite(tensor, name, path)
                    filled = _load_tensor(params[param_name], tensor, name, shard_id)
                    expected.difference_update((param_name, piece) for piece in filled)
    if expected:
        missing = sorted(_checkpoint_name(n, s, packed, experts) for n, s in expected)
        raise ValueError(f"checkpoint {model_dir!r} is missing tensors: {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    _finish_loading(model)


def _finish_loading(model: nn.Module):
    """What each linear's quantization does once its weights are in (e.g. quantize to FP8 at load)."""
    with torch.no_grad():
        for module in model.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0):
    """load_format="dummy": random weights where they live, no file read. As transformers initialises
    a model: matrices N(0, std) (std: the config's initializer_range), norm weights 1, biases 0.
    A mixture of experts' router is random too, so the routing is close to uniform."""
    params = dict(model.named_parameters())
    if any(p.dtype == torch.float8_e4m3fn for p in params.values()):
        raise ValueError('load_format="dummy" cannot draw FP8 weights: an FP8 checkpoint needs its files '
                         '(quantization="fp8" quantizes dummy bf16 weights at load instead)')
    generators = {}
    with torch.no_grad():
        for name, param in params.items():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, std, generator=generators[param.device])
    _finish_loading(model)


def _check_finite(tensor: torch.Tensor, name: str, path: str) -> torch.Tensor:
    """A NaN or Inf weight makes every logit NaN (and every sampled token 0) without an error: one
    reduction per tensor (per slice a rank reads, under tensor parallelism) catches a corrupt checkpoint."""
    if not tensor.is_floating_point():
        return tensor
    if tensor.dtype == torch.float8_e4m3fn:  # no isfinite for FP8; its only non-finite codes are NaN
        bad = (tensor.view(torch.uint8) & 0x7F) == 0x7F
    else:
        bad = ~torch.isfinite(tensor)
    if bad.any():
        num_bad = int(bad.sum())
        raise ValueError(f"tensor {name!r} in {os.path.basename(path)} has {num_bad} NaN/Inf values of "
                         f"{tensor.numel()}: the checkpoint is corrupt")
    return tensor


def _shards_of(param_name: str, packed: dict, experts: dict) -> list:
    pieces = [w.fills[0] for w in experts.values()
              if w.expert_id is not None and param_name.endswith("." + w.param_name)]
    if pieces:
        return pieces
    shards = [s for fragment, (p, s) in packed.items() if f".{p}." in param_name]
    return shards or [None]


def _checkpoint_name(param_name: str, shard_id, packed: dict, experts: dict) -> str:
    """The per-expert (hub) name of a missing piece of an experts' parameter."""
    for suffix, w in experts.items():
        if w.fills == (shard_id,) and param_name.endswith("." + w.param_name):
            return param_name.removesuffix(w.param_name) + suffix
    for fragment, (p, s) in packed.items():
        if s == shard_id and f".{p}." in param_name:
            return param_name.replace(f".{p}.", f".{fragment}.")
    return param_name


def build_model(model_dir: str, hf_config=None, dtype: torch.dtype = torch.float32, device="cpu",
                ctx: ModelContext | None = None, load_format: str = "auto") -> nn.Module:
    """Construct the registered model class for `model_dir` and load its weights.

    ctx: the tensor-parallel shard to hold and the linear layers' quantization (layers/context.py);
    None: the whole model, quantized as the checkpoint is (an FP8 checkpoint loads as FP8).
    load_format: "auto" reads the safetensors files; "dummy" draws random weights (init_dummy_weights)."""
    from minivllm.layers.quantization import get_quant_config
    from minivllm.models import get_model_class

    hf_config = hf_config or load_hf_config(model_dir)
    ctx = ctx or ModelContext(quant_config=get_quant_config(None, hf_config))
    model_cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, ctx)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model, getattr(hf_config, "initializer_range", None) or 0.02)
    else:
        load_model(model, model_dir, sharded=ctx.tp_size > 1)
    return model.eval()


def get_model(config, device: torch.device, rank: int = 0) -> nn.Module:
    """The engine's model: `config`'s checkpoint in its dtype on `device`, rank `rank`'s shard, with
    the linear layers' quantization the config resolved (an FP8 checkpoint loads as FP8)."""
    ctx = ModelContext(rank, config.tensor_parallel_size, config.quant_config)
    return build_model(config.model, config.hf_config, config.torch_dtype, device, ctx, config.load_format)
