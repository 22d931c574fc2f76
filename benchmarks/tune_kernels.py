"""GPU tuning driver for the Triton kernels: run the kernel tests, then time several tile configs
of prefill (vs torch SDPA flash / cuDNN) and decode (vs the device-to-device copy bandwidth).

    PYTHONPATH=. python benchmarks/tune_kernels.py --out /tmp/tune [--skip-tests] [--quick]
    PYTHONPATH=. python benchmarks/tune_kernels.py --out /tmp/tune --skip-tests --only chunk
        (prompts that continue a cached prefix: prefix hits and chunked prefill, block sizes 16/256)
    PYTHONPATH=. python benchmarks/tune_kernels.py --out /tmp/tune --skip-tests --only decode-fp8
        (decode over an FP8 cache: bytes read count 1 per element; wider tiles than bf16's, each
        with fp8_convert cvt / bits and min_block_m 16 / 64; --quick: the first tile's four)
    PYTHONPATH=. python benchmarks/tune_kernels.py --out /tmp/tune --skip-tests --only fp8-gemm
        (the block-FP8 GEMM's tiles at the Qwen3-0.6B / 8B linear shapes, against torch._scaled_mm)
    PYTHONPATH=. python benchmarks/tune_kernels.py --out /tmp/tune --only moe [--skip-tests]
        (the fused MoE's tiles per M bucket at Qwen3-30B-A3B's experts; runs tests/test_kernels_moe.py first)

Each provider is checked once against a reference before timing; timings are
triton.testing.do_bench medians. Prints a short table last and writes tune.json under --out.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import graph_replays
from minivllm.kernels import flash_attn_with_kvcache_ref
from minivllm.kernels.flash_attn_varlen import PrefillConfig, flash_attn_varlen_launch, prefill_config
from minivllm.kernels.paged_decode import (
    DecodeConfig, decode_config, decode_num_splits, paged_decode_launch,
)
from minivllm.kernels.quant_fp8 import kv_scale_from_amax, quantize_fp8_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
PREFILL_SHAPES = [(1, 4096), (4, 2048), (8, 1024), (16, 512), (1, 16384)]
DECODE_SHAPES = [(1, 1024), (1, 32768), (8, 32768), (64, 4096), (256, 1024), (256, 4096)]  # (1, 1024): batch-1 latency
# Run 1 (kernels/TUNING.md) swept 128x64/128x128 w8 s2-3, 128x32 w4 s3, 64x64 w4 s3 and decode tiles
# 32-128, w4/w8, s2/s3, 2-8 programs per SM; these are the survivors and their neighbours.
PREFILL_CONFIGS = [PrefillConfig(128, 128, 8, 3), PrefillConfig(128, 32, 4, 3), PrefillConfig(128, 32, 4, 4),
                   PrefillConfig(128, 32, 4, 2), PrefillConfig(64, 32, 4, 3), PrefillConfig(128, 64, 4, 2),
                   PrefillConfig(64, 64, 4, 4), PrefillConfig(128, 64, 8, 4)]
PREFILL_CONFIGS_D64 = [PrefillConfig(128, 64, 4, 3), PrefillConfig(128, 128, 8, 3), PrefillConfig(128, 32, 4, 3),
                       PrefillConfig(128, 64, 8, 3)]
# Chunks over a cached prefix: (batch, new tokens, cached prefix). The first four are bench_prefill's
# prefix-hit rows (half of 4096 / 2048 / 1024 / 512 cached), the rest chunked prefill's 2k chunks.
CHUNK_SHAPES = [(1, 2048, 2048), (4, 1024, 1024), (8, 512, 512), (16, 256, 256),
                (1, 2048, 8192), (1, 2048, 16384), (1, 2048, 32768)]
CHUNK_CONFIGS = [PrefillConfig(128, 128, 8, 3), PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 4, 3),
                 PrefillConfig(128, 32, 4, 3), PrefillConfig(64, 32, 4, 3), PrefillConfig(64, 64, 4, 3),
                 PrefillConfig(128, 128, 8, 4), PrefillConfig(128, 64, 8, 4), PrefillConfig(64, 64, 4, 4)]
DECODE_CONFIGS = [DecodeConfig(64, 4, 2, 8, 256), DecodeConfig(64, 4, 2, 4, 256), DecodeConfig(64, 4, 2, 16, 128),
                  DecodeConfig(64, 4, 3, 16, 128), DecodeConfig(32, 4, 3, 16, 64), DecodeConfig(64, 2, 2, 8, 256),
                  DecodeConfig(128, 4, 2, 8, 256),
                  DecodeConfig(64, 4, 2, 8, 256, fused_merge=True),  # the default tile, the splits merged in the kernel
                  # Finer splits for short contexts at small batches (batch 1 x 1024 has 4 splits of 256 tokens:
                  # 32 programs for 132 SMs); a grid of many sequences has few splits whatever the floor.
                  DecodeConfig(64, 4, 2, 8, 64), DecodeConfig(64, 4, 2, 8, 128), DecodeConfig(64, 4, 1, 8, 64),
                  DecodeConfig(32, 4, 2, 8, 32), DecodeConfig(64, 4, 2, 8, 64, fused_merge=True)]
# An FP8 tile of keys is half the bytes of a bf16 one: the sweep for FP8 caches reaches to wider tiles.
# Run 4 found it bound by per-key instructions, not bytes, so each tile runs with both code conversions
# (fp8_convert "cvt": the conversion instruction, "bits": integer ops, e4m3_bits_to_fp16) and with the
# dots' rows padded to 16 or 64 (min_block_m 64: Hopper's wgmma, the tile converted once into shared memory).
DECODE_FP8_TILES = DECODE_CONFIGS + [
    DecodeConfig(128, 8, 2, 8, 256), DecodeConfig(128, 4, 3, 8, 256), DecodeConfig(128, 8, 3, 8, 256),
    DecodeConfig(256, 8, 2, 8, 512), DecodeConfig(256, 4, 2, 8, 512), DecodeConfig(128, 4, 4, 16, 256)]
DECODE_FP8_CONFIGS = [replace(tile, fp8_convert=convert, min_block_m=rows) for tile in DECODE_FP8_TILES
                      for rows in (16, 64) for convert in ("cvt", "bits")]
# Block-FP8 GEMM tiles (kernels/fp8_gemm.py): gemm_config's choices and their neighbours; vLLM's tuned H200
# tables (fp8_w8a8, block [128, 128]) mostly pick 64 x 128 x 128 tiles, 4 warps, 3-4 stages above M = 128.
FP8_GEMM_SHAPES = {"0.6b": {"qkv": (4096, 1024), "gate_up": (6144, 1024), "down": (1024, 3072)},
                   "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}}
FP8_GEMM_BATCHES = (16, 64, 256, 2048)
FP8_GEMM_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                    for m, n, w, st in ((16, 64, 4, 5), (16, 128, 4, 5), (32, 128, 4, 4), (64, 64, 4, 3),
                                        (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (64, 256, 8, 3),
                                        (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 256, 8, 3))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke under TRITON_INTERPRET=1
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bf16 dot is broken
RESULTS = {"device": None, "torch": torch.__version__, "triton": triton.__version__, "rows": []}


def log(*args):
    print(*args, flush=True)


def record(kind, shape, provider, ms, rate, unit, ratio_note=""):
    RESULTS["rows"].append(dict(kind=kind, shape=shape, provider=provider, ms=ms, rate=rate, unit=unit,
                                note=ratio_note))
    log(f"{kind:8s} {shape:12s} {provider:34s} {ms:9.4f} ms {rate:8.2f} {unit} {ratio_note}")


def bench(fn):
    if DEVICE == "cpu":  # smoke run: one timed call
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth():
    """Device-to-device copy of 4 GiB: bytes read + bytes written per second."""
    src = torch.randn(2**30 if DEVICE == "cuda" else 2**20, device=DEVICE)  # 4 GiB fp32
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    tbps = 2 * src.numel() * 4 / ms / 1e9
    record("copy", "4GiB", "torch copy_", ms, tbps, "TB/s")
    del src, dst
    return tbps


def run_prefill(configs, shapes, head_dim=HEAD_DIM):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    best = {}
    for batch, seqlen in shapes:
        shape = f"{batch}x{seqlen}" + ("" if head_dim == HEAD_DIM else f"/d{head_dim}")
        total = batch * seqlen
        q = torch.randn(total, NUM_HEADS, head_dim, device=DEVICE, dtype=DTYPE)
        k = torch.randn(total, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE)
        v = torch.randn(total, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=DTYPE)
        cu = torch.arange(0, total + 1, seqlen, device=DEVICE, dtype=torch.int32)
        flops = 2 * batch * NUM_HEADS * seqlen * seqlen * head_dim  # causal forward (flash-attn's convention)
        # SDPA on the same data, KV heads repeated for the query heads: [B, H, S, D]
        qs = q.view(batch, seqlen, NUM_HEADS, head_dim).transpose(1, 2)
        ks = k.view(batch, seqlen, NUM_KV_HEADS, head_dim).transpose(1, 2).repeat_interleave(2, 1)
        vs = v.view(batch, seqlen, NUM_KV_HEADS, head_dim).transpose(1, 2).repeat_interleave(2, 1)
        sdpa_ms = {}
        ref = None
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                    out = fn()
                    ref = out if ref is None else ref
                    ms = bench(fn)
                sdpa_ms[name] = ms
                record("prefill", shape, name, ms, flops / ms / 1e9, "TFLOP/s")
            except Exception as e:  # backend not available on this build
                log(f"prefill {shape} {name} unavailable: {e!r}"[:200])
        if ref is None:  # no SDPA backend (CPU smoke run): the math path
            ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        ref = ref.transpose(1, 2).reshape(total, NUM_HEADS, head_dim)
        for config in configs:
            name = f"triton {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
            try:
                fn = lambda: flash_attn_varlen_launch(q, k, v, cu, cu, seqlen, None, True, None, config)  # noqa: E731
                err = (fn().float() - ref.float()).abs().max().item()
                if err > 5e-2:
                    log(f"prefill {shape} {name} WRONG: max abs err {err}")
                    continue
                ms = bench(fn)
            except Exception as e:
                log(f"prefill {shape} {name} failed: {e!r}"[:300])
                continue
            note = " ".join(f"{ms_peer / ms:.2f}x_{peer}" for peer, ms_peer in sdpa_ms.items())
            record("prefill", shape, name, ms, flops / ms / 1e9, "TFLOP/s", note)
            if shape not in best or ms < best[shape][1]:
                best[shape] = (name, ms)
        default = prefill_config(head_dim, seqlen, q.device)
        log(f"prefill {shape} wrapper default {default}; best {best.get(shape)}")
        del q, k, v, qs, ks, vs, ref
    return best


def paged_decode_case(batch, context, block_size, copies, kv_fp8=False):
    """`copies` independent caches (rotated while timing so the L2 cannot hold them) with shuffled
    block tables, all contexts full; kv_fp8: the caches in FP8 with their amax scales, each case then
    ending in (k_descale, v_descale)."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    cases = []
    for _ in range(copies):
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
        block_table = torch.randperm(num_blocks, device=DEVICE).int().view(batch, blocks_per_seq)
        q = torch.randn(batch, 1, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        seqlens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
        scales = (None, None)
        if kv_fp8:
            scales = (kv_scale_from_amax(k_cache), kv_scale_from_amax(v_cache))
            k_cache, v_cache = quantize_fp8_ref(k_cache, scales[0]), quantize_fp8_ref(v_cache, scales[1])
        cases.append((q, k_cache, v_cache, seqlens, block_table, *scales))
    return cases


def checked_graph_ms(label, launch, cases, wrong):
    """Milliseconds of `launch` in CUDA-graph replays over `cases`, after checking its output on the
    first: wrong(output) returns what is off, or None. A wrong output or a launch that raises is
    logged and gives None."""
    try:
        message = wrong(launch(cases[0]))
        if message:
            log(f"{label} WRONG: {message}")
            return None
        return bench(graph_replays(cases, launch))
    except Exception as e:
        log(f"{label} failed: {e!r}"[:300])
        return None


def run_decode(configs, shapes, copy_tbps, block_sizes=(16,), kv_fp8=False):
    best, kind = {}, "decode_fp8" if kv_fp8 else "decode"
    for block_size in block_sizes:
        for batch, context in shapes:
            shape = f"{batch}x{context}/b{block_size}"
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * (1 if kv_fp8 else 2)  # K and V, read once
            copies = max(1, min(4, int(2e9 // kv_bytes)))
            cases = paged_decode_case(batch, context, block_size, copies, kv_fp8)
            q, k_cache, v_cache, seqlens, block_table, k_descale, v_descale = cases[0]
            ref = flash_attn_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                              k_descale=k_descale, v_descale=v_descale)
            for config in configs:
                splits = decode_num_splits(batch, NUM_KV_HEADS, context, q.device, config)
                name = (f"triton n{config.block_n} w{config.num_warps} s{config.num_stages} "
                        f"p{config.programs_per_sm} m{config.min_split_tokens} splits{splits}")
                if kv_fp8:
                    name += f" m{config.min_block_m} {config.fp8_convert}"
                if config.fused_merge:
                    name += " fused-merge"
                launch = lambda c: paged_decode_launch(  # noqa: E731
                    c[0], c[1], c[2], c[3], c[4], None, True, splits, config, None, c[5], c[6])
                def wrong(out):
                    err = (out.float() - ref.float()).abs().max().item()
                    return f"max abs err {err}" if err > 5e-2 else None

                ms = checked_graph_ms(f"{kind} {shape} {name}", launch, cases, wrong)
                if ms is None:
                    continue
                tbps = kv_bytes / ms / 1e9
                record(kind, shape, name, ms, tbps, "TB/s", f"{tbps / copy_tbps:.0%}_of_copy")
                if shape not in best or ms < best[shape][1]:
                    best[shape] = (name, ms, tbps / copy_tbps)
            default = decode_config(HEAD_DIM, q.device)
            splits = decode_num_splits(batch, NUM_KV_HEADS, context, q.device, default)
            eager_ms = bench(lambda: paged_decode_launch(q, k_cache, v_cache, seqlens, block_table, None, True,
                                                         splits, default, None, k_descale, v_descale))
            record(kind, shape, "default, eager (no graph)", eager_ms, kv_bytes / eager_ms / 1e9, "TB/s",
                   f"{kv_bytes / eager_ms / 1e9 / copy_tbps:.0%}_of_copy")
            log(f"{kind} {shape} wrapper default {default}; best {best.get(shape)}")
            del cases, q, k_cache, v_cache, ref
    return best


MIXED_BATCHES = (256, 128, 48)
MIXED_CONFIGS = [DecodeConfig(64, 4, 2, 8, 256), DecodeConfig(64, 4, 3, 8, 256), DecodeConfig(64, 4, 4, 8, 256),
                 DecodeConfig(128, 4, 2, 8, 256), DecodeConfig(128, 8, 2, 8, 256), DecodeConfig(64, 8, 3, 8, 256),
                 DecodeConfig(64, 4, 2, 16, 256), DecodeConfig(64, 4, 2, 8, 128), DecodeConfig(32, 4, 4, 8, 128)]


def run_decode_mixed(configs, copy_tbps, block_size=16, table_blocks=257, seed=0):
    """The engine's decode: contexts uniform in [200, 2048] (the end-to-end workload's range),
    block tables as wide as max_model_len 4096 allows, sequences visited longest first."""
    import random

    rng = random.Random(seed)
    best = {}
    for batch in MIXED_BATCHES:
        contexts = [rng.randint(200, 2048) for _ in range(batch)]
        kv_bytes = 2 * sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2
        num_blocks = batch * table_blocks
        cases = []
        for _ in range(max(1, min(4, int(2e9 // kv_bytes)))):
            shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
            caches = [torch.randn(shape, device=DEVICE, dtype=DTYPE) for _ in range(2)]
            block_table = torch.randperm(num_blocks, device=DEVICE).int().view(batch, table_blocks)
            q = torch.randn(batch, 1, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
            seqlens = torch.tensor(contexts, device=DEVICE, dtype=torch.int32)
            order = torch.argsort(seqlens, descending=True).int()
            cases.append((q, *caches, seqlens, block_table, order))
        shape = f"mixed {batch}x[200,2048]"
        for config in configs:
            splits = decode_num_splits(batch, NUM_KV_HEADS, table_blocks * block_size, torch.device(DEVICE), config)
            name = (f"triton n{config.block_n} w{config.num_warps} s{config.num_stages} "
                    f"p{config.programs_per_sm} m{config.min_split_tokens} splits{splits}")
            for ordered in (True, False) if config == configs[0] else (True,):
                call = lambda c: paged_decode_launch(c[0], c[1], c[2], c[3], c[4], None, True, splits, config,  # noqa: E731
                                                     c[5] if ordered else None)
                try:
                    ms = bench(graph_replays(cases, call))
                except Exception as e:
                    log(f"decode {shape} {name} failed: {e!r}"[:300])
                    continue
                tbps = kv_bytes / ms / 1e9
                label = name + ("" if ordered else " batch order")
                record("decode", shape, label, ms, tbps, "TB/s", f"{tbps / copy_tbps:.0%}_of_copy")
                if shape not in best or ms < best[shape][1]:
                    best[shape] = (label, ms, tbps / copy_tbps)
        del cases
    return best


def run_prefix_hit(batch=4, seqlen=2048, block_sizes=(16, 256)):
    """Half of each sequence's keys already cached, the other half new (default config)."""
    new_len = seqlen // 2
    cached = seqlen - new_len
    flops = 4 * batch * NUM_HEADS * HEAD_DIM * (new_len * cached + new_len * new_len / 2)  # 4*D per visible pair
    for block_size in block_sizes:
        cases = paged_decode_case(batch, seqlen, block_size, 1)
        _, k_cache, v_cache, _, block_table = cases[0][:5]
        q = torch.randn(batch * new_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        cu_q = torch.arange(0, batch * new_len + 1, new_len, device=DEVICE, dtype=torch.int32)
        cu_k = torch.arange(0, batch * seqlen + 1, seqlen, device=DEVICE, dtype=torch.int32)
        config = prefill_config(HEAD_DIM, new_len, q.device, paged=True)
        fn = lambda: flash_attn_varlen_launch(q, k_cache, v_cache, cu_q, cu_k, new_len, None, True, block_table, config)  # noqa: E731
        ms = bench(fn)
        record("prefix", f"{batch}x{new_len}+{seqlen - new_len}/b{block_size}", f"triton default {config.block_m}x"
               f"{config.block_n}", ms, flops / ms / 1e9, "TFLOP/s")


def chunk_case(batch, new_len, prefix_len, block_size):
    """Each sequence's first prefix_len keys in a paged cache (shuffled blocks), its new_len new
    keys contiguous (the engine's layout), and the same keys dense for SDPA."""
    total = prefix_len + new_len
    blocks_per_seq = triton.cdiv(total, block_size)
    num_blocks = batch * blocks_per_seq
    k_all = torch.randn(num_blocks * block_size, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_all = torch.randn_like(k_all)
    perm = torch.randperm(num_blocks, device=DEVICE)
    k_cache, v_cache = torch.empty_like(k_all).view(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), \
        torch.empty_like(v_all).view(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache[perm] = k_all.view(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    v_cache[perm] = v_all.view(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    block_table = perm.view(batch, blocks_per_seq).to(torch.int32)
    per_seq = lambda t: t.view(batch, blocks_per_seq * block_size, NUM_KV_HEADS, HEAD_DIM)[:, :total]  # noqa: E731
    k_seq, v_seq = per_seq(k_all), per_seq(v_all)  # [batch, total, kvh, d]
    q = torch.randn(batch * new_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k_new = k_seq[:, prefix_len:].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    v_new = v_seq[:, prefix_len:].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    cu_q = torch.arange(0, batch * new_len + 1, new_len, device=DEVICE, dtype=torch.int32)
    cu_k = torch.arange(0, batch * total + 1, total, device=DEVICE, dtype=torch.int32)
    group = NUM_HEADS // NUM_KV_HEADS
    dense = (q.view(batch, new_len, NUM_HEADS, HEAD_DIM).transpose(1, 2),
             k_seq.transpose(1, 2).repeat_interleave(group, 1), v_seq.transpose(1, 2).repeat_interleave(group, 1))
    return (q, k_new, v_new, k_cache, v_cache, block_table, cu_q, cu_k), dense


def run_chunk(configs, shapes, block_sizes=(16, 256)):
    """Prompts that continue a cached prefix (prefix hits, chunked prefill) vs SDPA flash on the
    same keys held dense, with bottom-right causal alignment."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    best = {}
    for batch, new_len, prefix_len in shapes:
        flops = 4 * batch * NUM_HEADS * HEAD_DIM * (new_len * prefix_len + new_len * new_len / 2)  # 4*D per visible pair
        for block_size in block_sizes:
            shape = f"{batch}x{new_len}+{prefix_len}/b{block_size}"
            (q, k_new, v_new, k_cache, v_cache, block_table, cu_q, cu_k), (qs, ks, vs) = chunk_case(
                batch, new_len, prefix_len, block_size)
            mask = causal_lower_right(new_len, prefix_len + new_len)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # noqa: E731
            ref = sdpa().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
            sdpa_ms = None
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    sdpa_ms = bench(sdpa)
                record("chunk", shape, "sdpa_flash", sdpa_ms, flops / sdpa_ms / 1e9, "TFLOP/s")
            except Exception as e:
                log(f"chunk {shape} sdpa_flash unavailable: {e!r}"[:200])
            default = prefill_config(HEAD_DIM, new_len, q.device, paged=True)
            for config in dict.fromkeys([default] + list(configs)):
                name = f"triton {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
                name += " (default)" if config == default else ""
                fn = lambda: flash_attn_varlen_launch(q, k_new, v_new, cu_q, cu_k, new_len, None, True,  # noqa: E731
                                                      block_table, config, k_cache, v_cache)
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    if err > 5e-2:
                        log(f"chunk {shape} {name} WRONG: max abs err {err}")
                        continue
                    ms = bench(fn)
                except Exception as e:
                    log(f"chunk {shape} {name} failed: {e!r}"[:300])
                    continue
                note = f"{sdpa_ms / ms:.2f}x_sdpa_flash" if sdpa_ms else ""
                record("chunk", shape, name, ms, flops / ms / 1e9, "TFLOP/s", note)
                if shape not in best or ms < best[shape][1]:
                    best[shape] = (name, ms)
            del q, k_new, v_new, k_cache, v_cache, qs, ks, vs, ref
    return best


def run_fp8_gemm(configs, shapes, batches):
    """Each tile config of the block-FP8 GEMM at each (layer, M), CUDA-graph replays over enough copies of
    the weight to overflow L2, checked against the dequantize-then-matmul reference first; the peers are
    gemm_config's own choice and torch._scaled_mm (per-channel scales, cuBLASLt) on the same codes."""
    from minivllm.kernels import (
        per_token_group_quant_fp8_ref, scaled_mm_per_channel, w8a8_block_fp8_matmul, w8a8_block_fp8_matmul_ref,
    )
    from minivllm.kernels.fp8_gemm import gemm_config, quantize_fp8_blocks_ref
    from minivllm.kernels._common import num_sms

    best = {}
    for model, layers in shapes.items():
        for layer, (N, K) in layers.items():
            weight_bytes = N * K
            copies = max(1, min(4, int(2e8 // weight_bytes)))
            weights = []
            for _ in range(copies):
                w = torch.randn(N, K, device=DEVICE, dtype=DTYPE) * 0.02
                weights.append((*quantize_fp8_blocks_ref(w, 128, 128), *quantize_fp8_blocks_ref(w, 1, K)))
            for M in batches:
                shape = f"{model}_{layer}_M{M}"
                x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
                a, a_scale = per_token_group_quant_fp8_ref(x, 128)
                a1, a1_scale = per_token_group_quant_fp8_ref(x, K)
                cases = [(a, a_scale, b, b_scale, a1, a1_scale, b1, b1_scale) for b, b_scale, b1, b1_scale in weights]
                ref = w8a8_block_fp8_matmul_ref(a, a_scale, cases[0][2], cases[0][3], (128, 128), torch.float32)
                tol = 2e-2 * ref.abs().max().item()
                flops = 2 * M * N * K
                default = gemm_config(M, N, K, 128, num_sms(0) if DEVICE == "cuda" else 1)
                named = [("default " + _gemm_name(default), default)] + [(_gemm_name(c), dict(c, BLOCK_K=128,
                                                                                            GROUP_SIZE_M=8))
                                                                         for c in configs]
                for name, config in named:
                    launch = lambda c, config=config: w8a8_block_fp8_matmul(  # noqa: E731
                        c[0], c[1], c[2], c[3], (128, 128), DTYPE, config=config)
                    def wrong(out):
                        err = (out.float() - ref).abs().max().item()
                        return f"max abs err {err} > {tol}" if err > tol else None

                    ms = checked_graph_ms(f"fp8_gemm {shape} {name}", launch, cases, wrong)
                    if ms is None:
                        continue
                    record("fp8_gemm", shape, name, ms, flops / ms / 1e9, "TFLOP/s")
                    if not name.startswith("default") and (shape not in best or ms < best[shape][1]):
                        best[shape] = (name, ms)
                try:  # cuBLASLt only: on the CPU this says so and moves on
                    ms = bench(graph_replays(cases, lambda c: scaled_mm_per_channel(*c[4:], DTYPE)))
                    record("fp8_gemm", shape, "torch._scaled_mm (per-channel)", ms, flops / ms / 1e9, "TFLOP/s")
                except Exception as e:
                    log(f"fp8_gemm {shape} scaled_mm unavailable: {e!r}"[:200])
                del cases, x, a, a1, ref
            del weights
    return best


def _gemm_name(config):
    return f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"


# Fused MoE (kernels/fused_moe.py) at Qwen3-30B-A3B's experts (E=128, top-8, K=2048, N=768): a few
# MoEConfig values per M bucket around moe_config's placeholder, as (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
# num_warps, num_stages). The gate_up kernel keeps two accumulators (gate, up) per tile, so its tiles hold
# twice the registers and weight bytes of a plain GEMM's at the same BLOCK_N.
MOE_BATCHES = (1, 4, 16, 64, 256, 1024, 4096, 16384)
MOE_CONFIGS = {
    "decode": [(16, 64, 128, 1, 4, 3), (16, 32, 128, 1, 4, 4), (16, 64, 64, 1, 4, 4), (16, 128, 128, 1, 4, 2),
               (16, 64, 256, 1, 4, 2), (16, 128, 64, 1, 4, 3), (32, 64, 128, 1, 4, 3)],
    "mid": [(16, 64, 128, 1, 4, 3), (32, 64, 128, 8, 4, 3), (32, 128, 128, 8, 4, 2), (64, 64, 64, 8, 4, 3),
            (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 8, 4)],
    "prefill": [(64, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 3),
                (64, 256, 64, 8, 8, 3), (128, 128, 32, 8, 8, 4)],
}
# The few-pairs path's SmallMoEConfig values, as (BLOCK_N, BLOCK_K, num_warps[, sum_once]), swept up to
# MOE_SMALL_MAX_M tokens (beyond moe_config's SMALL_MAX_PAIRS: where the two paths cross).
MOE_SMALL_CONFIGS = [(16, 256, 4), (8, 256, 4), (32, 128, 4), (16, 512, 4), (32, 256, 8), (64, 128, 4),
                     # sum_once (the products summed after the loop): longer steps, fewer columns a program
                     (8, 256, 4, True), (4, 256, 4, True), (4, 512, 4, True), (2, 1024, 4, True), (8, 512, 8, True),
                     (4, 1024, 8, True)]
MOE_SMALL_MAX_M = 16
MOE_TESTS = ["tests/test_kernels_moe.py"]


def _moe_bucket(M):
    return "decode" if M <= 64 else "mid" if M <= 1024 else "prefill"


def _moe_name(config):
    if not hasattr(config, "BLOCK_M"):  # SmallMoEConfig
        return f"few-pairs {config.BLOCK_N}x{config.BLOCK_K} w{config.num_warps}" + (" once" if config.sum_once else "")
    return (f"{config.BLOCK_M}x{config.BLOCK_N}x{config.BLOCK_K} g{config.GROUP_M} w{config.num_warps} "
            f"s{config.num_stages}")


def run_moe(candidates, shape, batches, small_candidates=()):
    """Each MoEConfig of the M's bucket, and moe_config's own choice, in CUDA-graph replays over two
    routings (same weights: do_bench flushes L2 between calls), each checked against fused_moe_ref once
    per M. Rate: FLOPs = 2*M*topk*3*N*K (bench_moe.moe_flops) over the median time."""
    from benchmarks.bench_moe import QWEN3_30B_A3B, VLLM_FUSED_EXPERTS_MS, make_inputs, make_weights, moe_flops
    from minivllm.kernels.fused_moe import MoEConfig, SmallMoEConfig, fused_moe, fused_moe_ref, moe_config

    E, top_k, K, N = shape["num_experts"], shape["top_k"], shape["hidden_size"], shape["intermediate_size"]
    weights = make_weights(shape, DTYPE, DEVICE, seed=0)
    best = {}
    for M in batches:
        cases = [make_inputs(M, shape, weights, DTYPE, DEVICE, seed=1 + i).args() for i in range(2)]
        ref = fused_moe_ref(*cases[0]).float()
        tol = 4e-2 * max(1.0, ref.abs().max().item())  # bf16 rounding of act and of each slot's output
        flops = moe_flops(M, top_k, K, N)
        default = moe_config(M, E, N, K, top_k, DTYPE)
        configs = dict.fromkeys([default] + [MoEConfig(*c) for c in candidates[_moe_bucket(M)]]
                                + [SmallMoEConfig(*c) for c in small_candidates if M <= MOE_SMALL_MAX_M])
        for config in configs:
            name = _moe_name(config) + (" (default)" if config == default else "")
            launch = lambda c, config=config: fused_moe(*c, config=config)  # noqa: E731

            def wrong(out):
                err = (out.float() - ref).abs().max().item()
                return f"max abs err {err} > {tol}" if err > tol else None

            ms = checked_graph_ms(f"moe M={M} {name}", launch, cases, wrong)
            if ms is None:
                continue
            vllm_ms = VLLM_FUSED_EXPERTS_MS.get(M) if shape == QWEN3_30B_A3B and DTYPE == torch.bfloat16 else None
            record("moe", f"M{M}", name, ms, flops / ms / 1e9, "TFLOP/s",
                   f"{vllm_ms / ms:.2f}x_vllm_anchor" if vllm_ms else "")
            if f"M{M}" not in best or ms < best[f"M{M}"][1]:
                best[f"M{M}"] = (name, ms)
        del cases, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return best


def run_moe_section(args):
    """--only moe: the sweep, tune.json, then the best config per M against moe_config's choice and the
    vLLM anchor (bench_moe.VLLM_FUSED_EXPERTS_MS: vLLM 0.25.1 fused_experts, H200, 2026-12-01)."""
    from benchmarks.bench_moe import QWEN3_30B_A3B, TINY, VLLM_FUSED_EXPERTS_MS

    candidates, small, shape, batches = MOE_CONFIGS, MOE_SMALL_CONFIGS, QWEN3_30B_A3B, MOE_BATCHES
    if args.smoke:  # interpreter-sized: two small tiles, ragged M
        shape, batches = TINY, (1, 33)
        candidates = {bucket: [(16, 32, 32, 1, 4, 1), (32, 32, 32, 2, 4, 1)] for bucket in MOE_CONFIGS}
        small = [(16, 32, 4)]
    elif args.quick:
        candidates = {bucket: configs[:1] for bucket, configs in MOE_CONFIGS.items()}
        small = MOE_SMALL_CONFIGS[:2]
    best = run_moe(candidates, shape, batches, small)
    RESULTS["best_moe"] = best
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    log("best config per M; default: moe_config's choice, ms / the best's ms; vLLM: the anchor's ms / the best's ms")
    for shape_name, (name, ms) in best.items():
        default = next((r["ms"] for r in RESULTS["rows"] if r["kind"] == "moe" and r["shape"] == shape_name
                        and r["provider"].endswith("(default)")), None)
        vllm_ms = VLLM_FUSED_EXPERTS_MS.get(int(shape_name[1:])) if shape is QWEN3_30B_A3B else None
        log(f"best {shape_name:7s} {name:34s} {ms:.4f} ms"
            + (f"  default {default / ms:.2f}x" if default else "") + (f"  vLLM {vllm_ms / ms:.2f}x" if vllm_ms else ""))


def run_tests(out_dir, test_files=("tests/test_kernels_store.py", "tests/test_kernels_prefill.py",
                                    "tests/test_kernels_decode.py")):
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", *test_files, "-x", "-q", "-n", "8", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(out_dir, "tests.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    log("\n".join(tail))
    log(f"tests: exit {proc.returncode} in {time.time() - start:.0f} s")
    return proc.returncode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/tune")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--only", choices=["prefill", "decode", "decode-fp8", "mixed", "chunk", "fp8-gemm", "moe"],
                        default=None,
                        help="mixed: only the engine-like decode batches of mixed context lengths; "
                             "chunk: only prompts that continue a cached prefix; decode-fp8: decode over FP8 caches")
    parser.add_argument("--quick", action="store_true", help="first config of each kernel only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of this script)")
    parser.add_argument("--decode-shapes", default=None,
                        help="batch x context list for the decode sweep, e.g. 1x1024,4x1024 (default: DECODE_SHAPES)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    global PREFILL_SHAPES, DECODE_SHAPES
    if args.smoke:
        PREFILL_SHAPES, DECODE_SHAPES = [(2, 64)] * 3, [(2, 64)]
    if args.decode_shapes:
        DECODE_SHAPES = [tuple(int(n) for n in shape.split("x")) for shape in args.decode_shapes.split(",")]
    if not args.skip_tests:
        RESULTS["tests_exit"] = run_tests(args.out, *([MOE_TESTS] if args.only == "moe" else []))
    prefill_configs = PREFILL_CONFIGS[:1] if args.quick else PREFILL_CONFIGS
    decode_configs = DECODE_CONFIGS[:1] if args.quick else DECODE_CONFIGS
    copy_tbps = copy_bandwidth()
    if args.only == "chunk":
        shapes = [(1, 32, 40), (2, 17, 33)] if args.smoke else CHUNK_SHAPES
        best = run_chunk(CHUNK_CONFIGS[:2] if args.smoke else CHUNK_CONFIGS, shapes)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        for shape, (name, ms) in best.items():
            sdpa = next((r["ms"] for r in RESULTS["rows"] if r["kind"] == "chunk" and r["shape"] == shape
                         and r["provider"] == "sdpa_flash"), None)
            log(f"best {shape:22s} {name:40s} {ms:.4f} ms" + (f" {sdpa / ms:.2f}x sdpa_flash" if sdpa else ""))
        return
    if args.only == "decode-fp8":
        few = DECODE_FP8_CONFIGS[:4]  # the first tile, each conversion and row padding
        best = run_decode(few if args.smoke or args.quick else DECODE_FP8_CONFIGS,
                          DECODE_SHAPES, copy_tbps, kv_fp8=True)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        for shape, (name, ms, frac) in best.items():
            log(f"best {shape:22s} {name:50s} {ms:.4f} ms {frac:.0%} of copy (FP8 bytes)")
        return
    if args.only == "moe":
        run_moe_section(args)
        return
    if args.only == "fp8-gemm":
        shapes, batches = FP8_GEMM_SHAPES, FP8_GEMM_BATCHES
        if args.smoke:
            shapes, batches = {"tiny": {"qkv": (256, 256)}}, (1, 33)
        best = run_fp8_gemm(FP8_GEMM_CONFIGS[:2] if args.smoke or args.quick else FP8_GEMM_CONFIGS, shapes, batches)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        log("best tile per shape; then each peer's ms / the best tile's ms (above 1: the tile is faster)")
        for shape, (name, ms) in best.items():
            peers = {r["provider"]: r["ms"] for r in RESULTS["rows"] if r["kind"] == "fp8_gemm" and r["shape"] == shape
                     and (r["provider"].startswith("default") or r["provider"].startswith("torch"))}
            log(f"best {shape:20s} {name:18s} {ms:.4f} ms " + " ".join(f"{p}: {v / ms:.2f}x" for p, v in peers.items()))
        return
    if args.only == "mixed":
        global MIXED_BATCHES
        MIXED_BATCHES = (4, 2) if args.smoke else MIXED_BATCHES
        best = run_decode_mixed(MIXED_CONFIGS[:2] if args.smoke else MIXED_CONFIGS, copy_tbps)
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        for shape, (name, ms, frac) in best.items():
            log(f"best {shape:22s} {name:50s} {ms:.4f} ms {frac:.0%} of copy")
        return
    best_prefill = {} if args.only == "decode" else run_prefill(prefill_configs, PREFILL_SHAPES)
    if not args.quick and args.only != "decode":
        best_prefill.update(run_prefill(PREFILL_CONFIGS_D64, PREFILL_SHAPES[:3], head_dim=64))
        run_prefix_hit(*((2, 64) if DEVICE == "cpu" else ()))
    best_decode = {} if args.only == "prefill" else run_decode(decode_configs, DECODE_SHAPES, copy_tbps)
    RESULTS["best_prefill"], RESULTS["best_decode"] = best_prefill, best_decode
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    log("\n=== summary (copy %.2f TB/s) ===" % copy_tbps)
    for shape, (name, ms) in best_prefill.items():
        peers = {r["provider"]: r["ms"] for r in RESULTS["rows"] if r["kind"] == "prefill" and r["shape"] == shape
                 and r["provider"].startswith("sdpa")}
        log(f"prefill {shape:10s} {name:28s} {ms:.4f} ms " + " ".join(f"{p}:{v / ms:.2f}x" for p, v in peers.items()))
    for shape, (name, ms, frac) in best_decode.items():
        log(f"decode  {shape:14s} {name:40s} {ms:.4f} ms {frac:.0%} of copy")


if __name__ == "__main__":
    main()
