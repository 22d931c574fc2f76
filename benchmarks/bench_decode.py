"""Decode attention, paired: a naive PyTorch gather, our Triton `flash_attn_with_kvcache` over a
paged cache with a shuffled block table, and torch SDPA's flash and cuDNN backends on the same K/V
laid out contiguously (the unpaged upper reference), beside the copy bandwidth measured in the
same run. With `--kv-cache-dtype auto fp8` ours also runs over an FP8 (e4m3) copy of the cache
(rows `ours_fp8`, `ours_fp8_graph`: 1 byte per element read). vLLM: benchmarks/kernels/benchmark_paged_attention.py.

    python -m benchmarks.bench_decode [--block-sizes 16 256] [--kv-cache-dtype auto fp8] [--cpu-smoke] [--out-dir DIR]
"""
import argparse
import math
import sys
from dataclasses import dataclass, field

import torch

from benchmarks import common

NAME = "bench_decode"
DEFAULT_SHAPES = "1x32768,8x32768,64x4096,256x1024,256x4096"
PROVIDERS = {
    "ours": "minivllm.kernels.flash_attn_with_kvcache (Triton), paged cache, shuffled block table",
    "ours_fp8": "the same kernel over an FP8 (float8_e4m3fn) copy of the cache, per-tensor scales; "
                "checked against the reference on the same FP8 cache",
    "naive": "vectorised torch gather of the paged cache (k_cache[block_table]) + MATH SDPA",
    "sdpa_flash": "torch SDPA FLASH_ATTENTION on the same K/V contiguous [B, H_kv, ctx, D]",
    "sdpa_cudnn": "torch SDPA CUDNN_ATTENTION on the same K/V contiguous [B, H_kv, ctx, D]",
    "sdpa_efficient": "torch SDPA EFFICIENT_ATTENTION on the same K/V contiguous [B, H_kv, ctx, D]",
    "note": "`variant` says how GQA was passed (enable_gqa; repeat_kv reads group x the bytes the "
            "formula counts). The copy ceiling counts bytes read + written.",
}


def kv_bytes_read(batch, context, num_kv_heads, head_dim, dtype):
    """Bytes of K and V a decode step must read: 2 (K, V) * B * ctx * H_kv * D * itemsize
    (itemsize of the cache: 2 for bf16/fp16, 1 for FP8)."""
    return 2 * batch * context * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class DecodeInputs:
    """q: [batch, 1, num_heads, head_dim]; k, v: [batch, context, num_kv_heads, head_dim].
    Layouts (paged per block size, contiguous per head) are built once and memoised."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seed: int
    layouts: dict = field(default_factory=dict)

    def paged(self, block_size):
        """(k_cache, v_cache [num_blocks, block_size, H_kv, D], cache_seqlens [B] int32,
        block_table [B, blocks_per_seq] int32) holding the same K/V as self.k / self.v.

            block_table[b] = [ 41, 7, 93, ...]   physical block of logical block 0, 1, 2, ...
            k_cache[41]    = tokens 0..block_size-1 of sequence b
        """
        if block_size not in self.layouts:
            batch, context = self.k.shape[:2]
            blocks_per_seq = math.ceil(context / block_size)
            generator = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(batch * blocks_per_seq, generator=generator).to(self.k.device)
            block_table = order.view(batch, blocks_per_seq).to(torch.int32)
            caches = [self._scatter(x, block_table, block_size) for x in (self.k, self.v)]
            cache_seqlens = torch.full((batch,), context, dtype=torch.int32, device=self.k.device)
            self.layouts[block_size] = (*caches, cache_seqlens, block_table)
        return self.layouts[block_size]

    @staticmethod
    def _scatter(x, block_table, block_size):
        batch, context = x.shape[:2]
        blocks_per_seq = block_table.shape[1]
        padded = torch.zeros(batch, blocks_per_seq * block_size, *x.shape[2:], dtype=x.dtype, device=x.device)
        padded[:, :context] = x
        cache = torch.empty(batch * blocks_per_seq, block_size, *x.shape[2:], dtype=x.dtype, device=x.device)
        cache[block_table.flatten().long()] = padded.view(-1, block_size, *x.shape[2:])
        return cache  # [num_blocks, block_size, H_kv, D]

    def paged_fp8(self, block_size):
        """The paged layout with FP8 caches: (k_cache, v_cache, cache_seqlens, block_table,
        k_scale, v_scale), each cache quantized with its amax scale (as calculate_kv_scales does)."""
        from minivllm.kernels.quant_fp8 import kv_scale_from_amax, quantize_fp8_ref

        key = ("fp8", block_size)
        if key not in self.layouts:
            k_cache, v_cache, cache_seqlens, block_table = self.paged(block_size)
            k_scale, v_scale = kv_scale_from_amax(self.k), kv_scale_from_amax(self.v)
            self.layouts[key] = (quantize_fp8_ref(k_cache, k_scale), quantize_fp8_ref(v_cache, v_scale),
                                 cache_seqlens, block_table, k_scale, v_scale)
        return self.layouts[key]

    def contiguous(self):
        """(q [B, H, 1, D], k, v [B, H_kv, ctx, D]) for SDPA."""
        if "contiguous" not in self.layouts:
            self.layouts["contiguous"] = tuple(t.transpose(1, 2).contiguous() for t in (self.q, self.k, self.v))
        return self.layouts["contiguous"]


def make_inputs(batch, context, args, dtype, device, seed):
    shape_kv = (batch, context, args.num_kv_heads, args.head_dim)
    return DecodeInputs(
        q=torch.randn(batch, 1, args.num_heads, args.head_dim, dtype=dtype, device=device),
        k=torch.randn(shape_kv, dtype=dtype, device=device),
        v=torch.randn(shape_kv, dtype=dtype, device=device),
        seed=seed,
    )


# ----------------------------------------------------------------------------- providers

def _ours_inputs(x, block_size, kv_cache_dtype):
    """(q, k_cache, v_cache, kwargs of flash_attn_with_kvcache) for the cache dtype asked for."""
    if kv_cache_dtype == "fp8":
        k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale = x.paged_fp8(block_size)
        scales = dict(k_descale=k_scale, v_descale=v_scale)
    else:
        (k_cache, v_cache, cache_seqlens, block_table), scales = x.paged(block_size), {}
    return x.q, k_cache, v_cache, dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=True, **scales)


def _ours_name(kv_cache_dtype):
    return "ours" if kv_cache_dtype == "auto" else f"ours_{kv_cache_dtype}"


def ours_provider(block_size, kv_cache_dtype="auto"):
    from minivllm.kernels import flash_attn_with_kvcache

    def run(q, k_cache, v_cache, kwargs):
        return flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)

    return [common.Provider(_ours_name(kv_cache_dtype), lambda x: _ours_inputs(x, block_size, kv_cache_dtype),
                            run, label=f"block {block_size}")]


def naive_gather_decode(q, k_cache, v_cache, cache_seqlens, block_table):
    """What one writes first in PyTorch: gather every sequence's blocks into a dense tensor,
    then run attention with a length mask. Returns [batch, 1, num_heads, head_dim]."""
    batch, blocks_per_seq = block_table.shape
    block_size = k_cache.shape[1]
    k = k_cache[block_table.long()].flatten(1, 2).transpose(1, 2)  # [B, H_kv, blocks*block_size, D]
    v = v_cache[block_table.long()].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(blocks_per_seq * block_size, device=q.device)
    mask = positions[None, :] < cache_seqlens[:, None]  # [B, ctx]: the last block may be partial
    out = common.sdpa("math", q.transpose(1, 2), k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out.transpose(1, 2)


def naive_provider(block_size):
    def prepare(x):
        k_cache, v_cache, cache_seqlens, block_table = x.paged(block_size)
        return x.q, k_cache, v_cache, cache_seqlens, block_table

    return [common.Provider("naive", prepare, naive_gather_decode, label=f"block {block_size}")]


def sdpa_providers(backend, num_heads, num_kv_heads):
    """One decode query sees every key: is_causal must stay False (SDPA's causal is top-left)."""
    variants = []
    for label, transform, kwargs in common.gqa_variants(num_heads, num_kv_heads):
        def prepare(x, transform=transform):
            q, k, v = x.contiguous()
            return q, transform(k), transform(v)

        def run(q, k, v, kwargs=kwargs):
            return common.sdpa(backend, q, k, v, **kwargs)

        variants.append(common.Provider(f"sdpa_{backend}", prepare, run,
                                        unpack=lambda out: out.transpose(1, 2), label=label))
    return variants


# ----------------------------------------------------------------------------- run

def ours_graph_provider(block_size, kv_cache_dtype="auto"):
    """Ours replayed from a CUDA graph, as the engine runs it: no launch or allocation overhead in
    the timing (it dominates small cases such as 1 x 32768, where the reads take ~35 us)."""
    from minivllm.kernels import flash_attn_with_kvcache

    def prepare(x):
        q, k_cache, v_cache, kwargs = _ours_inputs(x, block_size, kv_cache_dtype)
        flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        return graph, out

    def run(graph, out):
        graph.replay()
        return out

    return [common.Provider(f"{_ours_name(kv_cache_dtype)}_graph", prepare, run, label=f"block {block_size}, CUDA graph")]


def run_shape(batch, context, args, dtype, device, copy_tbps):
    """All providers at one (batch, context); ours per block size and cache dtype, naive per
    block size. FP8 rows are checked against the reference on the same FP8 cache and count
    1 byte per element read."""
    from minivllm.kernels import flash_attn_with_kvcache_ref
    from minivllm.kernels.quant_fp8 import FP8_DTYPE

    cache_dtypes = {"auto": dtype, "fp8": FP8_DTYPE}
    num_bytes = kv_bytes_read(batch, context, args.num_kv_heads, args.head_dim, dtype)
    num_sets = common.num_input_sets(num_bytes, args.rotate_factor)
    input_sets = [make_inputs(batch, context, args, dtype, device, args.seed + i) for i in range(num_sets)]
    x = input_sets[0]

    def reference(kv_cache_dtype):
        q, k_cache, v_cache, kwargs = _ours_inputs(x, args.block_sizes[0], kv_cache_dtype)
        return flash_attn_with_kvcache_ref(q, k_cache, v_cache, **kwargs)

    refs = {kv: reference(kv) for kv in dict.fromkeys(["auto", *args.kv_cache_dtype])}  # the peers read "auto"
    runs = []
    for kv in args.kv_cache_dtype:
        runs += [(_ours_name(kv), kv, bs, ours_provider(bs, kv)) for bs in args.block_sizes]
        if torch.cuda.is_available():
            runs += [(f"{_ours_name(kv)}_graph", kv, bs, ours_graph_provider(bs, kv)) for bs in args.block_sizes]
    runs += [("naive", "auto", bs, naive_provider(bs)) for bs in args.block_sizes]
    runs += [(f"sdpa_{b}", "auto", None, sdpa_providers(b, args.num_heads, args.num_kv_heads))
             for b in args.sdpa_backends]
    rows = []
    for key, kv, block_size, variants in runs:
        result = common.measure(variants, input_sets, refs[kv], common.ATOL[dtype], args.warmup_ms, args.rep_ms)
        row = {"case": f"{batch}x{context}", "batch": batch, "context": context, "provider": key,
               "block_size": block_size, "kv_cache_dtype": str(cache_dtypes[kv]).replace("torch.", ""),
               "kv_bytes": kv_bytes_read(batch, context, args.num_kv_heads, args.head_dim, cache_dtypes[kv]),
               "num_input_sets": num_sets, **result.as_dict()}
        row["provider"] = key
        if result.ms:
            row["TBps"] = row["kv_bytes"] / (result.ms * 1e-3) / 1e12  # K+V bytes read / median time
            row["fraction_of_copy"] = row["TBps"] / copy_tbps
        rows.append(row)
        print(f"  {row['case']:>9} {key:>11} {'' if block_size is None else block_size:>4}: {row['status']:>11} "
              f"{common.fmt(row.get('ms'))} ms {common.fmt(row.get('TBps'))} TB/s "
              f"{row.get('variant', '')} {row.get('error', '')[:120]}", flush=True)
    _add_ratios(rows)
    return rows


def _add_ratios(rows):
    """ours_speedup = peer ms / our ms, against ours at the same block size (or the first one
    for the unpaged SDPA rows)."""
    ours = {r["block_size"]: r for r in rows if r["provider"] == "ours" and r.get("ms")}
    first = next(iter(ours.values()), None)
    for r in rows:
        mine = ours.get(r["block_size"], first)
        if mine and r.get("ms"):
            r["ours_speedup"] = r["ms"] / mine["ms"]
            r["ours_block_size"] = mine["block_size"]


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="batch x context list")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="cache dtypes for our kernel (auto: the model's dtype; fp8: e4m3, 1 byte per element)")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    parser.add_argument("--sdpa-backends", nargs="*", default=["flash", "cudnn"],
                        choices=sorted(common.SDPA_BACKENDS))
    parser.add_argument("--rotate-factor", type=float, default=4, help="input sets span this x L2")
    return common.add_common_args(parser)


CPU_SMOKE = dict(shapes="1x80,3x48", block_sizes=[16, 32], num_heads=4, num_kv_heads=2, head_dim=64,
                 copy_bytes=16 * 2**20)  # tiny sizes for the Triton interpreter: seconds on a CPU


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {args.dtype}, "
          f"heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim}", flush=True)
    copy = common.measure_copy_bandwidth(args.copy_bytes or 2**30)
    print(f"  copy ceiling: {common.fmt(copy['TBps'])} TB/s (read + written)", flush=True)
    rows = []
    for shape in filter(None, args.shapes.split(",")):
        batch, context = map(int, shape.lower().split("x"))
        rows += run_shape(batch, context, args, dtype, device, copy["TBps"])
        if on_cuda:
            torch.cuda.empty_cache()
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args),
               "providers": PROVIDERS, "sdpa_backends": common.sdpa_backend_status(dtype, args.head_dim),
               "ceilings": {"copy": copy}, "byte_formula": kv_bytes_read.__doc__, "results": rows}
    common.write_json(args.out_dir, NAME, payload)
    plot(rows, args, env, copy)
    print_summary(rows, copy)
    return payload


def _series_name(row):
    return row["provider"] + (f" (block {row['block_size']})" if row["block_size"] else "")


def plot(rows, args, env, copy):
    cases = list(dict.fromkeys(r["case"] for r in rows))
    names = list(dict.fromkeys(_series_name(r) for r in rows))
    series = {n: [next((r.get("TBps") for r in rows if _series_name(r) == n and r["case"] == c
                        and r["status"] == "ok"), None) for c in cases] for n in names}
    panel = {"title": "decode attention, one query token: TB/s of K+V read", "categories": cases,
             "series": series, "ylabel": "TB/s", "hline": ("copy (read + write)", copy["TBps"])}
    common.plot_panels(args.out_dir / f"{NAME}.png", [panel],
                       f"{env['device']} | {args.dtype} | heads {args.num_heads}/{args.num_kv_heads} "
                       f"d{args.head_dim} | torch {env['torch']} triton {env['triton']} | {env['date_utc']}")


def print_summary(rows, copy):
    table = [[r["case"], r["provider"], r["block_size"] or "-", r["status"], common.fmt(r.get("ms")),
              common.fmt(r.get("TBps")), _percent(r.get("fraction_of_copy")), common.fmt(r.get("ours_speedup")),
              common.fmt(r.get("max_abs_err"), 2), r.get("variant", "")] for r in rows]
    common.print_table(["B x ctx", "provider", "block", "status", "ms", "TB/s", "of copy", "ours speedup",
                        "max|err|", "variant"], table,
                       title=f"Decode attention (bytes = 2*B*ctx*H_kv*D*itemsize, FP8 rows 1 byte; "
                             f"copy {common.fmt(copy['TBps'])} TB/s)")


def _percent(fraction):
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
