"""The vLLM linear-layer family: column/row parallel linears and their packed variants.

A column-parallel layer splits its *output* features across tensor-parallel ranks, a row-parallel
layer its *input* features (followed by an all-reduce). Packed layers (QKV, gate+up) hold several
checkpoint tensors in one weight; each parameter's `weight_loader` knows where a shard goes.
A layer's `quant_method` creates its parameters and computes the product: unquantized, or FP8
weights with their scales (layers/quantization.py). A block-FP8 scale parameter
(`weight_scale_inv`, one value per 128 x 128 block) is cut by the same loaders, its rows and
columns counted in blocks.
vLLM: vllm/model_executor/layers/linear.py.
"""
import torch
from torch import nn

from minivllm.layers.context import ModelContext
from minivllm.layers.quantization import UnquantizedLinearMethod
from minivllm.utils.distributed import all_reduce


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator} (tensor parallelism splits it evenly)")
    return numerator // denominator


def _check_full_shape(loaded, rows: int, cols: int, name: str):
    """A packed shard must have its full (all ranks) shape before this rank slices it."""
    if tuple(loaded.shape) != (rows, cols)[: loaded.dim()]:
        raise ValueError(f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
                         f"the model expects {(rows, cols)[: loaded.dim()]}")


def _in_blocks(param, num_rows: int) -> int:
    """Weight rows -> rows of `param`: a block scale has one row per block_size[0] weight rows (the
    layers check at construction that every cut falls on a block boundary)."""
    block_size = getattr(param, "block_size", None)
    return num_rows if block_size is None else num_rows // block_size[0]


def _copy_checked(param: torch.Tensor, loaded, name: str):
    """Copy a checkpoint tensor (or a lazily read slice of one, see models/loader.py) into `param`."""
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.load()
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch for {name}: checkpoint has {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    if (param.dtype == torch.float8_e4m3fn) != (loaded.dtype == torch.float8_e4m3fn):
        # a cast between FP8 codes and real values would load garbage without a scale
        raise ValueError(f"dtype mismatch for {name}: checkpoint has {loaded.dtype}, the model expects {param.dtype} "
                         "(an FP8 checkpoint needs its quantization_config in config.json)")
    param.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b). `tp_dim` is the weight dimension split across ranks (None: replicated)."""

    tp_dim: int | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, ctx: ModelContext = ModelContext(),
                 output_partition_sizes: list[int] | None = None):
        """input_size, output_size: this rank's; output_partition_sizes: the packed parts of this rank's
        output (default: one part)."""
        super().__init__()
        self.tp_rank, self.tp_size = ctx.tp_rank, ctx.tp_size
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = ctx.quant_config.get_linear_method() if ctx.quant_config else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, output_partition_sizes or [output_size])  # sets self.weight (+ scales)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor along `tp_dim`."""
        if self.tp_dim is None or self.tp_size == 1 or (self.tp_dim == 1 and param.dim() == 1):
            return loaded
        size = param.shape[self.tp_dim]
        return loaded.narrow(self.tp_dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = ""):
        _copy_checked(param.data, self._shard(param, loaded), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    tp_dim = 0

    def __init__(self, input_size, output_size, bias=False, ctx=ModelContext(), output_partition_sizes=None):
        super().__init__(input_size, _divide(output_size, ctx.tp_size), bias, ctx, output_partition_sizes)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored back to back, e.g. [gate | up] of the MLP."""

    def __init__(self, input_size, output_sizes: list[int], bias=False, ctx=ModelContext()):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, ctx, [_divide(size, ctx.tp_size) for size in output_sizes])

    def weight_loader(self, param, loaded, shard_id: int, name: str = ""):
        shard_size = _in_blocks(param, self.output_sizes[shard_id] // self.tp_size)
        shard_offset = _in_blocks(param, sum(self.output_sizes[:shard_id]) // self.tp_size)
        _check_full_shape(loaded, _in_blocks(param, self.output_sizes[shard_id]), param.shape[-1], name)
        target = param.data.narrow(0, shard_offset, shard_size)
        _copy_checked(target, loaded.narrow(0, self.tp_rank * shard_size, shard_size), name)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. Each rank holds its query heads and KV heads:

        weight rows: | q: num_heads * head_dim | k: num_kv_heads * head_dim | v: same as k |

    With more ranks than KV heads, each KV head is replicated on tp_size / total_num_kv_heads ranks
    (8 KV heads on 16 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1, ...), as vLLM does.
    """

    def __init__(self, hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=False, ctx=ModelContext()):
        tp_size = ctx.tp_size
        self.head_dim = head_dim
        self.num_heads = _divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads)  # each head on the same number of ranks
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = _divide(total_num_kv_heads, tp_size), 1
        self.total_num_kv_heads = total_num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size  # this rank's share * tp_size
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, output_size, bias, ctx, [self.q_size, self.kv_size, self.kv_size])

    def weight_loader(self, param, loaded, shard_id: str, name: str = ""):
        q_size = _in_blocks(param, self.num_heads * self.head_dim)
        kv_size = _in_blocks(param, self.num_kv_heads * self.head_dim)
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        # which slice of the checkpoint tensor this rank holds, counted in units of `size` rows
        index = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        total_heads = self.num_heads * self.tp_size if shard_id == "q" else self.total_num_kv_heads
        _check_full_shape(loaded, _in_blocks(param, total_heads * self.head_dim), param.shape[-1], name)
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded.narrow(0, index * size, size), name)


class RowParallelLinear(LinearBase):
    tp_dim = 1

    def __init__(self, input_size, output_size, bias=False, ctx=ModelContext()):
        super().__init__(_divide(input_size, ctx.tp_size), output_size, bias, ctx)

    def forward(self, x):
        # The bias is added once, after the partial sums of every rank are reduced.
        y = self.quant_method.apply(self, x, None)
        y = all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias
