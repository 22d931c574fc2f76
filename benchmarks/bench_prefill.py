"""Prefill attention, paired: naive PyTorch, our Triton `flash_attn_varlen_func`, torch SDPA's
flash and cuDNN backends, measured in one run; plus the prefix-hit case (half the keys in a paged
cache). vLLM: benchmarks/kernels/benchmark_attention.py (flash-attn's benchmark_flash_attention.py).

    python -m benchmarks.bench_prefill [--head-dim 64] [--cpu-smoke] [--out-dir DIR]
"""
import argparse
import math
import sys
from dataclasses import dataclass

import torch

from benchmarks import common

NAME = "bench_prefill"
DEFAULT_SHAPES = "1x4096,4x2048,8x1024,16x512,1x16384"
DEFAULT_MIXED = "4096,2048,1000,512,233,17,7,1"
PROVIDERS = {
    "ours": "minivllm.kernels.flash_attn_varlen_func (Triton); prefix hit: K/V read through block_table",
    "sdpa_flash": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2), dense [B, H, S, D]",
    "sdpa_cudnn": "torch SDPA, CUDNN_ATTENTION backend, dense [B, H, S, D]",
    "sdpa_efficient": "torch SDPA, EFFICIENT_ATTENTION backend, dense [B, H, S, D]",
    "naive": "torch SDPA, MATH backend (materialises the scores): the naive PyTorch version",
    "note": "SDPA gets the same K/V contiguous; a ragged batch is one SDPA call per sequence; "
            "`variant` says how GQA and the causal mask were passed (enable_gqa, or repeat_kv "
            "when the backend refused it; prefix hit: causal_lower_right or an explicit mask)",
}
REF_SCORE_BYTES = 2**31  # the float32 reference runs head chunks whose scores fit in this


@dataclass
class Case:
    """One benchmark shape: sequence lengths and, for prefix hits, how many keys are cached."""
    name: str
    seqlens_k: list
    num_cached: list  # per sequence; queries are the last seqlen_k - num_cached tokens

    @property
    def seqlens_q(self):
        return [s - c for s, c in zip(self.seqlens_k, self.num_cached)]

    @property
    def prefix_hit(self):
        return any(self.num_cached)


def causal_flops(case, num_heads, head_dim):
    """Forward FLOPs of causal attention. Unmasked, QK^T and PV cost 2 * Sq * Sk * D FLOPs each
    per head (a multiply-add is 2 FLOPs); the causal mask keeps the area Sq*(Sk-Sq) + Sq^2/2
    (flash-attn's convention: the diagonal's extra Sq/2 is ignored). All tokens new
    (Sq = Sk = S) gives 2 * B * H * S^2 * D."""
    flops = 0
    for seqlen_q, seqlen_k in zip(case.seqlens_q, case.seqlens_k):
        unmasked_pairs = seqlen_q * (seqlen_k - seqlen_q) + seqlen_q**2 / 2
        flops += 4 * num_heads * head_dim * unmasked_pairs  # 2 matmuls x 2 FLOPs per MAC
    return flops


# ----------------------------------------------------------------------------- inputs

@dataclass
class PrefillInputs:
    """q: [total_q, num_heads, head_dim] (the new tokens); k, v: [total_k, num_kv_heads,
    head_dim] (all keys of each sequence, packed); paged copies are made on demand."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    case: Case


def cu_seqlens(seqlens, device):
    return torch.tensor([0] + list(_accumulate(seqlens)), dtype=torch.int32, device=device)


def _accumulate(values):
    total = 0
    for v in values:
        total += v
        yield total


def make_inputs(case, num_heads, num_kv_heads, head_dim, dtype, device):
    total_q, total_k = sum(case.seqlens_q), sum(case.seqlens_k)
    return PrefillInputs(
        q=torch.randn(total_q, num_heads, head_dim, dtype=dtype, device=device),
        k=torch.randn(total_k, num_kv_heads, head_dim, dtype=dtype, device=device),
        v=torch.randn(total_k, num_kv_heads, head_dim, dtype=dtype, device=device),
        cu_seqlens_q=cu_seqlens(case.seqlens_q, device),
        cu_seqlens_k=cu_seqlens(case.seqlens_k, device),
        case=case,
    )


def to_paged(k, v, seqlens, block_size, generator):
    """Scatter packed K/V [total_k, kv_heads, d] into paged caches with a shuffled block table.

    Returns (k_cache, v_cache [num_blocks, block_size, kv_heads, d], block_table [batch,
    max_blocks] int32). Sequence i's token t lives in block block_table[i, t // block_size] at
    slot t % block_size; K and V share the table, as in the engine.
    """
    blocks_per_seq = [math.ceil(s / block_size) for s in seqlens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, generator=generator).to(k.device)  # shuffled physical ids
    block_table = torch.zeros(len(seqlens), max(blocks_per_seq), dtype=torch.int32, device=k.device)
    k_cache = torch.zeros(num_blocks, block_size, *k.shape[1:], dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    start_block, start_token = 0, 0
    for i, (seqlen, nblocks) in enumerate(zip(seqlens, blocks_per_seq)):
        block_table[i, :nblocks] = order[start_block:start_block + nblocks]
        t = torch.arange(seqlen, device=k.device)
        slots = block_table[i, t // block_size].long() * block_size + t % block_size
        k_cache.view(-1, *k.shape[1:])[slots] = k[start_token:start_token + seqlen]
        v_cache.view(-1, *v.shape[1:])[slots] = v[start_token:start_token + seqlen]
        start_block, start_token = start_block + nblocks, start_token + seqlen
    return k_cache, v_cache, block_table


def reference(inputs, paged, causal=True):
    """float32 `flash_attn_varlen_ref`, run on groups of KV heads so that the scores of a
    16k-token sequence fit in memory. Returns [total_q, num_heads, head_dim]."""
    from minivllm.kernels import flash_attn_varlen_ref

    num_heads, num_kv_heads = inputs.q.shape[1], inputs.k.shape[1]
    group = num_heads // num_kv_heads
    case = inputs.case
    score_bytes = 4 * group * max(case.seqlens_q) * max(case.seqlens_k)
    kv_chunk = max(1, min(num_kv_heads, REF_SCORE_BYTES // score_bytes))
    k, v, block_table = paged if paged else (inputs.k, inputs.v, None)
    out = torch.empty_like(inputs.q)
    for h in range(0, num_kv_heads, kv_chunk):
        heads_q = slice(h * group, (h + kv_chunk) * group)
        out[:, heads_q] = flash_attn_varlen_ref(
            inputs.q[:, heads_q], k[..., h:h + kv_chunk, :], v[..., h:h + kv_chunk, :],
            inputs.cu_seqlens_q, inputs.cu_seqlens_k, max(case.seqlens_q), max(case.seqlens_k),
            causal=causal, block_table=block_table)
    return out


# ----------------------------------------------------------------------------- providers

def ours_provider(paged_of):
    """Our Triton kernel; with a prefix hit it reads K/V through the block table, as the engine does."""
    from minivllm.kernels import flash_attn_varlen_func

    def prepare(x):
        k, v, block_table = paged_of(x) if x.case.prefix_hit else (x.k, x.v, None)
        return (x.q, k, v, x.cu_seqlens_q, x.cu_seqlens_k, max(x.case.seqlens_q),
                max(x.case.seqlens_k), block_table)

    def run(q, k, v, cu_q, cu_k, max_q, max_k, block_table):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                      block_table=block_table)

    return [common.Provider("ours", prepare, run, label="triton")]


def _dense_batches(x, transform):
    """Split packed tensors into SDPA batches [b, heads, s, d]: one dense batch when all
    sequences have the same lengths, else one batch per sequence (a Python loop, as a user of
    dense SDPA would write for a ragged batch)."""
    case = x.case
    lens_q, lens_k = case.seqlens_q, case.seqlens_k
    if len(set(lens_q)) == 1 and len(set(lens_k)) == 1:
        b = len(lens_q)
        dense = lambda t, s: t.view(b, s, *t.shape[1:]).transpose(1, 2).contiguous()  # noqa: E731
        return [(dense(x.q, lens_q[0]), transform(dense(x.k, lens_k[0])), transform(dense(x.v, lens_k[0])))]
    batches = []
    cq, ck = x.cu_seqlens_q.tolist(), x.cu_seqlens_k.tolist()
    for i in range(len(lens_q)):
        one = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731
        batches.append((one(x.q, cq[i], cq[i + 1]), transform(one(x.k, ck[i], ck[i + 1])),
                        transform(one(x.v, ck[i], ck[i + 1]))))
    return batches


def _unpack_dense(outs):
    # [b, heads, s, d] per batch -> packed [total_q, heads, d]
    return torch.cat([o.transpose(1, 2).flatten(0, 1) for o in outs])


def _mask_kwargs(mask_mode, seqlen_q, seqlen_k, device):
    """How to ask SDPA for causal attention aligned bottom-right (query i sees keys
    j <= i + seqlen_k - seqlen_q). With seqlen_q == seqlen_k it is plain is_causal."""
    if mask_mode == "is_causal":
        return {"is_causal": True}
    if mask_mode == "causal_lower_right":
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(seqlen_q, seqlen_k)}
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return {"attn_mask": j <= i + (seqlen_k - seqlen_q)}  # explicit bool mask [seqlen_q, seqlen_k]


def sdpa_providers(name, backend, mask_modes, num_heads, num_kv_heads):
    """SDPA on one backend, one variant per (mask mode, GQA mode); `measure` keeps the first
    that runs and matches the reference."""
    variants = []
    for mask_mode in mask_modes:
        for gqa_label, transform, gqa_kwargs in common.gqa_variants(num_heads, num_kv_heads):
            def prepare(x, transform=transform, gqa_kwargs=gqa_kwargs, mask_mode=mask_mode):
                return (_with_kwargs(_dense_batches(x, transform), mask_mode, gqa_kwargs),)

            def run(batches, backend=backend):
                return [common.sdpa(backend, q, k, v, **kw) for q, k, v, kw in batches]

            label = "+".join(p for p in (mask_mode, gqa_label) if p)
            variants.append(common.Provider(name, prepare, run, _unpack_dense, label=label))
    return variants


def _with_kwargs(batches, mask_mode, gqa_kwargs):
    return [(q, k, v, {**_mask_kwargs(mask_mode, q.shape[2], k.shape[2], q.device), **gqa_kwargs})
            for q, k, v in batches]


def naive_providers(case, num_heads, num_kv_heads, max_scores):
    """The naive version: torch's math SDPA (materialises the [heads, Sq, Sk] scores)."""
    scores = sum(num_heads * sq * sk for sq, sk in zip(case.seqlens_q, case.seqlens_k))
    if scores > max_scores:
        return f"skipped: {scores:.3g} score elements > --naive-max-scores {max_scores:.3g}"
    modes = ["explicit_mask"] if case.prefix_hit else ["is_causal"]
    return sdpa_providers("naive (math SDPA)", "math", modes, num_heads, num_kv_heads)


# ----------------------------------------------------------------------------- run

def run_case(case, args, dtype, device):
    """Measure every provider on one case; returns a list of result dicts."""
    flops = causal_flops(case, args.num_heads, args.head_dim)
    elements_per_set = (sum(case.seqlens_q) * args.num_heads + 2 * sum(case.seqlens_k) * args.num_kv_heads) * args.head_dim
    bytes_per_set = elements_per_set * torch.finfo(dtype).bits // 8  # q, k, v
    num_sets = common.num_input_sets(bytes_per_set, args.rotate_factor)
    input_sets = [make_inputs(case, args.num_heads, args.num_kv_heads, args.head_dim, dtype, device)
                  for _ in range(num_sets)]
    generator = torch.Generator().manual_seed(args.seed)
    paged_cache = {}

    def paged_of(x):  # (k_cache, v_cache, block_table), built once per input set
        if id(x) not in paged_cache:
            paged_cache[id(x)] = to_paged(x.k, x.v, case.seqlens_k, args.block_size, generator)
        return paged_cache[id(x)]

    ref = reference(input_sets[0], paged_of(input_sets[0]) if case.prefix_hit else None)
    atol = common.ATOL[dtype]
    mask_modes = (["causal_lower_right", "explicit_mask"] if case.prefix_hit else ["is_causal"])
    providers = {"ours": ours_provider(paged_of)}
    for backend in args.sdpa_backends:
        providers[f"sdpa_{backend}"] = sdpa_providers(f"sdpa_{backend}", backend, mask_modes,
                                                      args.num_heads, args.num_kv_heads)
    providers["naive"] = naive_providers(case, args.num_heads, args.num_kv_heads, args.naive_max_scores)
    rows = []
    for key, variants in providers.items():
        if isinstance(variants, str):  # skipped, with the reason
            result = common.Measurement(key, "skipped", error=variants)
        else:
            result = common.measure(variants, input_sets, ref, atol, args.warmup_ms, args.rep_ms)
            result.provider = key
        row = {"case": case.name, "prefix_hit": case.prefix_hit, "seqlens_k": case.seqlens_k,
               "num_cached": case.num_cached, "flops": flops, "num_input_sets": num_sets,
               **result.as_dict()}
        if result.ms:
            row["TFLOPs"] = flops / (result.ms * 1e-3) / 1e12  # achieved = causal FLOPs / median time
        rows.append(row)
        print(f"  {case.name:>22} {key:>12}: {row['status']:>11} "
              f"{common.fmt(row.get('ms'))} ms {common.fmt(row.get('TFLOPs'))} TFLOP/s "
              f"{row.get('variant', '')} {row.get('error', '')[:120]}", flush=True)
    _add_ratios(rows)
    return rows


def _add_ratios(rows):
    """ours / peer as a speed ratio (peer ms / our ms): > 1 means ours is faster."""
    ours = next((r for r in rows if r["provider"] == "ours" and r.get("ms")), None)
    for r in rows:
        if ours and r.get("ms"):
            r["ours_speedup"] = r["ms"] / ours["ms"]


def parse_cases(args):
    cases = []
    for shape in filter(None, args.shapes.split(",")):
        batch, seqlen = map(int, shape.lower().split("x"))
        cases.append(Case(f"{batch}x{seqlen}", [seqlen] * batch, [0] * batch))
    if args.mixed:
        lens = [int(s) for s in args.mixed.split(",")]
        cases.append(Case(f"mixed({len(lens)} seqs,{sum(lens)} tok)", lens, [0] * len(lens)))
    for shape in filter(None, args.prefix_shapes.split(",")):
        batch, seqlen = map(int, shape.lower().split("x"))
        cases.append(Case(f"prefix-hit {batch}x{seqlen}", [seqlen] * batch, [seqlen // 2] * batch))
    return cases


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS list, all tokens new")
    parser.add_argument("--mixed", default=DEFAULT_MIXED, help="lengths of the mixed batch ('' to skip)")
    parser.add_argument("--prefix-shapes", default=DEFAULT_SHAPES,
                        help="BxS list for the prefix-hit case: first S/2 keys cached ('' to skip)")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    parser.add_argument("--block-size", type=int, default=16, help="paged cache block (prefix-hit case)")
    parser.add_argument("--sdpa-backends", nargs="*", default=["flash", "cudnn"],
                        choices=sorted(common.SDPA_BACKENDS))
    parser.add_argument("--naive-max-scores", type=float, default=2**31,
                        help="skip the naive provider when it would materialise more score elements")
    parser.add_argument("--rotate-factor", type=float, default=4, help="input sets span this x L2")
    return common.add_common_args(parser)


CPU_SMOKE = dict(shapes="1x64,2x32", mixed="1,7,40", prefix_shapes="2x32", num_heads=4, num_kv_heads=2,
                 head_dim=64)  # tiny sizes for the Triton interpreter: seconds on a CPU


def main(argv=None):
    run = common.start_run(build_parser(), argv, CPU_SMOKE)
    args, on_cuda, dtype, device, env = run.args, run.on_cuda, run.dtype, run.device, run.env
    print(f"{NAME}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {args.dtype}, "
          f"heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim}", flush=True)
    ceilings = {"matmul": common.measure_matmul_rate(512 if args.cpu_smoke else 8192, dtype)}
    print(f"  matmul ceiling: {common.fmt(ceilings['matmul']['TFLOPs'])} TFLOP/s", flush=True)
    rows = []
    for case in parse_cases(args):
        rows += run_case(case, args, dtype, device)
        common.sync()
        torch.cuda.empty_cache() if on_cuda else None
    payload = {"benchmark": NAME, "environment": env, "options": common.options_dict(args),
               "providers": PROVIDERS, "sdpa_backends": common.sdpa_backend_status(dtype, args.head_dim),
               "ceilings": ceilings, "flop_convention": causal_flops.__doc__, "results": rows}
    common.write_json(args.out_dir, NAME, payload)
    plot(rows, args, env, ceilings)
    print_summary(rows, ceilings)
    return payload


def plot(rows, args, env, ceilings):
    panels = []
    for prefix_hit, title in ((False, "causal prefill, all tokens new"),
                              (True, f"prefix hit: first half of the keys in a paged cache (block {args.block_size})")):
        sub = [r for r in rows if r["prefix_hit"] == prefix_hit]
        if not sub:
            continue
        cases = list(dict.fromkeys(r["case"].removeprefix("prefix-hit ") for r in sub))
        providers = list(dict.fromkeys(r["provider"] for r in sub))
        series = {p: [next((r.get("TFLOPs") for r in sub if r["provider"] == p
                            and r["case"].removeprefix("prefix-hit ") == c and r["status"] == "ok"), None)
                      for c in cases] for p in providers}
        panels.append({"title": title, "categories": cases, "series": series, "ylabel": "TFLOP/s",
                       "hline": ("torch.matmul", ceilings["matmul"]["TFLOPs"])})
    common.plot_panels(args.out_dir / f"{NAME}.png", panels,
                       f"{env['device']} | {args.dtype} | heads {args.num_heads}/{args.num_kv_heads} "
                       f"d{args.head_dim} | torch {env['torch']} triton {env['triton']} | {env['date_utc']}")


def print_summary(rows, ceilings):
    table = [[r["case"], r["provider"], r["status"], common.fmt(r.get("ms")), common.fmt(r.get("TFLOPs")),
              common.fmt(r.get("ours_speedup")), common.fmt(r.get("max_abs_err"), 2), r.get("variant", "")]
             for r in rows]
    common.print_table(["case", "provider", "status", "ms", "TFLOP/s", "ours speedup", "max|err|", "variant"],
                       table, title=f"Prefill attention (causal FLOPs = 2*B*H*S^2*D; torch.matmul "
                                    f"{common.fmt(ceilings['matmul']['TFLOPs'])} TFLOP/s)")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
