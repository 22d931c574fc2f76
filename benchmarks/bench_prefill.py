"""Prefill attention, paired: naive PyTorch, our Triton `flash_attn_varlen_func`, torch SDPA's
flash and cuDNN backends, measured in one run; plus the cases where part of the keys sit in a
paged cache: prefix hits (half the keys cached), chunked prefill (a 2k chunk over an 8k-32k cached
prefix; a 16k prompt computed in 2k chunks, one launch per chunk as the engine's steps run them)
and a mixed step (64 decode rows + one 2k chunk).
vLLM: benchmarks/kernels/benchmark_attention.py (flash-attn's benchmark_flash_attention.py).

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
    "ours": "minivllm.kernels.flash_attn_varlen_func (Triton) as the engine calls it: a cached prefix "
            "read through block_table, the new tokens' K/V contiguous; mixed step: decode rows through "
            "flash_attn_with_kvcache, the chunk through flash_attn_varlen_func (two launches)",
    "ours_unified": "mixed step in one flash_attn_varlen_func launch (decode rows as 1-token chunks)",
    "sdpa_flash": "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2), dense [B, H, S, D]",
    "sdpa_cudnn": "torch SDPA, CUDNN_ATTENTION backend, dense [B, H, S, D]",
    "sdpa_efficient": "torch SDPA, EFFICIENT_ATTENTION backend, dense [B, H, S, D]",
    "naive": "torch SDPA, MATH backend (materialises the scores): the naive PyTorch version",
    "note": "SDPA gets the same K/V contiguous; a ragged batch is one SDPA call per run of sequences "
            "of equal lengths (one call per chunk of a chunk series, two for a mixed step); "
            "`variant` says how GQA and the causal mask were passed (enable_gqa, or repeat_kv "
            "when the backend refused it; prefix hit: causal_lower_right or an explicit mask)",
}
REF_SCORE_BYTES = 2**31  # the float32 reference runs head chunks whose scores fit in this


@dataclass
class Case:
    """One benchmark shape: sequence lengths and, for prefix hits and chunks, how many keys are cached."""
    name: str
    seqlens_k: list
    num_cached: list  # per sequence; queries are the last seqlen_k - num_cached tokens
    sequential: bool = False  # the sequences are chunks of one prompt: one launch each, in order
    num_decodes: int = 0  # a mixed step: the first sequences are decode rows (one query each)

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


def reference(inputs, causal=True):
    """float32 `flash_attn_varlen_ref` over every key contiguous (the paged caches hold the same
    keys), run on groups of KV heads so that the scores of a 16k-token sequence fit in memory.
    Returns [total_q, num_heads, head_dim]."""
    from minivllm.kernels import flash_attn_varlen_ref

    num_heads, num_kv_heads = inputs.q.shape[1], inputs.k.shape[1]
    group = num_heads // num_kv_heads
    case = inputs.case
    score_bytes = 4 * group * max(case.seqlens_q) * max(case.seqlens_k)
    kv_chunk = max(1, min(num_kv_heads, REF_SCORE_BYTES // score_bytes))
    k, v = inputs.k, inputs.v
    out = torch.empty_like(inputs.q)
    for h in range(0, num_kv_heads, kv_chunk):
        heads_q = slice(h * group, (h + kv_chunk) * group)
        out[:, heads_q] = flash_attn_varlen_ref(
            inputs.q[:, heads_q], k[..., h:h + kv_chunk, :], v[..., h:h + kv_chunk, :],
            inputs.cu_seqlens_q, inputs.cu_seqlens_k, max(case.seqlens_q), max(case.seqlens_k),
            causal=causal)
    return out


# ----------------------------------------------------------------------------- providers

def _new_keys(x):
    """The new tokens' K/V of every sequence, packed like q (the engine's layout)."""
    rows = torch.cat([torch.arange(start + cached, end, device=x.k.device) for start, end, cached in
                      zip(x.cu_seqlens_k.tolist(), x.cu_seqlens_k.tolist()[1:], x.case.num_cached)])
    return x.k[rows], x.v[rows]


def _chunk_args(x, paged_of, rows):
    """flash_attn_varlen_func arguments for the sequences `rows` (a slice), as the engine passes
    them: the cached prefix through block_table, the new keys contiguous."""
    k_cache, v_cache, block_table = paged_of(x)
    k_new, v_new = _new_keys(x)
    cu_q, cu_k = x.cu_seqlens_q.tolist(), x.cu_seqlens_k.tolist()
    q0, q1 = cu_q[rows.start], cu_q[rows.stop]
    lens_q, lens_k = x.case.seqlens_q[rows], x.case.seqlens_k[rows]
    cache = {}
    if any(x.case.num_cached[rows]):
        cache = dict(block_table=block_table[rows], k_cache=k_cache, v_cache=v_cache)
    return (x.q[q0:q1], k_new[q0:q1], v_new[q0:q1], cu_seqlens(lens_q, x.q.device),
            cu_seqlens(lens_k, x.q.device), max(lens_q), max(lens_k), cache)


def ours_providers(paged_of, case):
    """Our Triton kernels, called as the engine calls them (and the alternatives worth comparing)."""
    from minivllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, cache):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, **cache)

    if case.num_decodes:  # a mixed step: decode launch + chunk launch
        nd = case.num_decodes

        def prepare(x):
            k_cache, v_cache, block_table = paged_of(x)
            context_lens = torch.tensor(case.seqlens_k[:nd], dtype=torch.int32, device=x.q.device)
            return (x.q[:nd], k_cache, v_cache, context_lens, block_table[:nd].contiguous(),
                    _chunk_args(x, paged_of, slice(nd, len(case.seqlens_k))))

        def run(q_decode, k_cache, v_cache, context_lens, block_table, chunk):
            decoded = flash_attn_with_kvcache(q_decode.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                              block_table=block_table, causal=True)
            return torch.cat([decoded.squeeze(1), varlen(*chunk)])

        def prepare_unified(x):
            return (_chunk_args(x, paged_of, slice(0, len(case.seqlens_k))),)

        return [common.Provider("ours", prepare, run, label="decode + varlen launches")], \
            [common.Provider("ours_unified", prepare_unified, lambda chunk: varlen(*chunk), label="one varlen launch")]
    if case.sequential:  # chunks of one prompt, one launch each
        def prepare(x):
            return ([_chunk_args(x, paged_of, slice(i, i + 1)) for i in range(len(case.seqlens_k))],)

        return [common.Provider("ours", prepare, lambda chunks: torch.cat([varlen(*c) for c in chunks]),
                                label="one launch per chunk")], None
    if not case.prefix_hit:
        def prepare(x):
            return (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, max(x.case.seqlens_q),
                    max(x.case.seqlens_k), {})

        return [common.Provider("ours", prepare, varlen, label="triton")], None

    return [common.Provider("ours", lambda x: _chunk_args(x, paged_of, slice(0, len(case.seqlens_k))), varlen,
                            label="prefix paged, new K/V contiguous")], None


def _dense_batches(x, transform):
    """Split packed tensors into SDPA batches [b, heads, s, d]: consecutive sequences of equal
    query and key lengths make one dense batch (a ragged batch is a Python loop, as a user of
    dense SDPA would write it)."""
    case = x.case
    cq, ck = x.cu_seqlens_q.tolist(), x.cu_seqlens_k.tolist()
    lens = list(zip(case.seqlens_q, case.seqlens_k))
    batches, i = [], 0
    while i < len(lens):
        j = i
        while j < len(lens) and lens[j] == lens[i]:
            j += 1
        len_q, len_k = lens[i]
        dense = lambda t, a, b, s: t[a:b].view(j - i, s, *t.shape[1:]).transpose(1, 2).contiguous()  # noqa: E731
        batches.append((dense(x.q, cq[i], cq[j], len_q), transform(dense(x.k, ck[i], ck[j], len_k)),
                        transform(dense(x.v, ck[i], ck[j], len_k))))
        i = j
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

    ref = reference(input_sets[0])
    atol = common.ATOL[dtype]
    mask_modes = (["causal_lower_right", "explicit_mask"] if case.prefix_hit else ["is_causal"])
    ours, alternative = ours_providers(paged_of, case)
    providers = {"ours": ours}
    if alternative:
        providers[alternative[0].name] = alternative
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
        row = {"case": case.name, "prefix_hit": case.prefix_hit, "seqlens_k": case.seqlens_k[:8],
               "num_cached": case.num_cached[:8], "num_seqs": len(case.seqlens_k), "flops": flops,
               "num_input_sets": num_sets,
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
    return cases + chunk_cases(args)


def chunk_cases(args):
    """Chunked prefill: one chunk over a long cached prefix; a whole prompt in chunks; a mixed step."""
    chunk, cases = args.chunk_len, []
    for prefix in (int(p) for p in filter(None, args.chunk_prefixes.split(","))):
        cases.append(Case(f"chunk {chunk} over {prefix}", [prefix + chunk], [prefix]))
    for prompt in (int(p) for p in filter(None, args.chunk_series.split(","))):
        starts = list(range(0, prompt, chunk))
        cases.append(Case(f"{prompt} in {chunk}-token chunks", [min(s + chunk, prompt) for s in starts], starts,
                          sequential=True))
    if args.mixed_decodes:
        nd, context = args.mixed_decodes, args.decode_context
        cases.append(Case(f"{nd} decodes (ctx {context}) + chunk {chunk} over {chunk}",
                          [context] * nd + [2 * chunk], [context - 1] * nd + [chunk], num_decodes=nd))
    return cases


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS list, all tokens new")
    parser.add_argument("--mixed", default=DEFAULT_MIXED, help="lengths of the mixed batch ('' to skip)")
    parser.add_argument("--prefix-shapes", default=DEFAULT_SHAPES,
                        help="BxS list for the prefix-hit case: first S/2 keys cached ('' to skip)")
    parser.add_argument("--chunk-len", type=int, default=2048, help="chunked prefill: tokens per chunk")
    parser.add_argument("--chunk-prefixes", default="8192,16384,32768",
                        help="cached prefix lengths, one chunk over each ('' to skip)")
    parser.add_argument("--chunk-series", default="16384", help="prompt lengths computed in chunks ('' to skip)")
    parser.add_argument("--mixed-decodes", type=int, default=64, help="decode rows beside one chunk (0 to skip)")
    parser.add_argument("--decode-context", type=int, default=2048, help="context of each decode row")
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
                 head_dim=64, chunk_len=16, chunk_prefixes="40", chunk_series="48", mixed_decodes=3,
                 decode_context=40)  # tiny sizes for the Triton interpreter: seconds on a CPU


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
                              (True, f"cached prefix in a paged cache (block {args.block_size}): prefix hits, chunks")):
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
