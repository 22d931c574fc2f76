"""Steps of a few tokens through small-batch GEMVs: a ModelRunner layer that, in steps of at most
MAX_TOKENS tokens, runs each decoder layer's linears as kernels/gemv.py, with the RMSNorms (and their
residual adds) folded into the QKV and gate/up GEMVs and SiLU-and-mul into the down GEMV.

    one decoder layer, the model's own forward:      with this layer (<= MAX_TOKENS tokens):
        add + RMSNorm, QKV                               add + RMSNorm + QKV    one GEMV
        attention (its prologue, the kernel), o_proj     attention, o_proj      o_proj a GEMV
        add + RMSNorm, gate/up                           add + RMSNorm + gate/up  one GEMV
        SiLU-and-mul, down                               SiLU-and-mul + down   one GEMV

At batch 1 each kernel's fixed cost outweighs the few microseconds its weights take to read: three
kernels fewer per layer, and split-K programs that read every weight once across all SMs. Larger
steps take the model's own forward: measured on an H100 (benchmarks/README.md, 2026-12-07), the
GEMVs made a Qwen3-0.6B decode step 1.16x faster at batch 1, level at batch 2 and 1.32x slower at
batch 4, so MAX_TOKENS is 1 (the kernel itself takes up to 16 rows). Dense, unquantized linears only:
FP8 weights keep their GEMMs and a mixture-of-experts MLP its kernel (the norm still folds into QKV).
On by default on CUDA (`small_batch_gemv=None`): on an H100 the 256-request throughput was level with
it and batch 1 1.13x faster, and the whole suite passed on the GPU with it on (benchmarks/README.md).
vLLM: its small-batch decode runs cuBLAS GEMVs behind the fused norm and activation kernels.
"""
from minivllm.layers.quantization import UnquantizedLinearMethod
from minivllm.models.transformer import DecoderLayer, DecoderMLP
from minivllm.utils.distributed import all_reduce

MAX_TOKENS = 1  # the most tokens a step may have to take the GEMVs (see above: where they pay)


def _gemv(*args, **kwargs):
    from minivllm.kernels.gemv import gemv

    return gemv(*args, **kwargs)


def fits(linear, x) -> bool:
    """A GEMV can replace `linear` on x: unquantized weights, a few rows of the weight's dtype."""
    return (type(linear.quant_method) in (UnquantizedLinearMethod, GemvLinearMethod) and x.dim() == 2 and x.shape[0] <= MAX_TOKENS
            and x.dtype == linear.weight.dtype and x.stride(-1) == 1)


class GemvLinearMethod(UnquantizedLinearMethod):
    """y = x W^T (+ b) as a GEMV for a few rows, F.linear otherwise (o_proj, the linears outside the layers)."""

    def apply(self, layer, x, bias):
        if fits(layer, x):
            return _gemv(x, layer.weight, bias)
        return super().apply(layer, x, bias)


def norm_linear(norm, linear, x, residual):
    """(linear(norm(x + residual)), x + residual) in one GEMV; the first layer has no residual yet: x is it."""
    if residual is None:
        return _gemv(x, linear.weight, linear.bias, prologue="rms_norm", norm_weight=norm.weight, eps=norm.eps), x
    return _gemv(x, linear.weight, linear.bias, prologue="add_rms_norm", norm_weight=norm.weight, residual=residual,
                 eps=norm.eps)


def silu_down(down_proj, gate_up):
    """down_proj(silu_and_mul(gate_up)) in one GEMV, then the row-parallel reduction and bias."""
    y = all_reduce(_gemv(gate_up, down_proj.weight, prologue="silu_and_mul"), down_proj.tp_size)
    return y if down_proj.bias is None else y + down_proj.bias


class GemvDecoderLayer(DecoderLayer):
    """DecoderLayer whose steps of <= MAX_TOKENS tokens fold the norms and SiLU into the GEMVs."""

    def forward(self, positions, hidden_states, residual):
        attn, mlp = self.self_attn, self.mlp
        if not fits(attn.qkv_proj, hidden_states):
            return super().forward(positions, hidden_states, residual)
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden_states, residual)
        hidden_states = attn.forward_qkv(positions, qkv)
        dense = isinstance(mlp, DecoderMLP)
        if dense and fits(mlp.gate_up_proj, hidden_states) and fits(mlp.down_proj, hidden_states):
            gate_up, residual = norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, hidden_states, residual)
            return silu_down(mlp.down_proj, gate_up), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return mlp(hidden_states), residual


def use_small_batch_gemvs(model):
    """Swap the GEMV paths into a built model, in place (same modules, same weights)."""
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            module.__class__ = GemvDecoderLayer
        if type(getattr(module, "quant_method", None)) is UnquantizedLinearMethod:
            module.quant_method = GemvLinearMethod()


class SmallBatchGemv:
    """ModelRunner layer: the model with small-batch GEMVs in its decoder layers (`load_model`)."""

    def load_model(self):
        model = super().load_model()
        use_small_batch_gemvs(model)
        return model
