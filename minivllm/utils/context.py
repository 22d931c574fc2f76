"""Per-step attention metadata, handed from the ModelRunner to every Attention layer.

The runner builds one `AttentionMetadata` per forward step and sets it for the duration of the
forward with `set_forward_context(...)`; layers read it with `get_forward_context()`.
vLLM: vllm/forward_context.py and the backends' `AttentionMetadata` classes.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What attention needs to know about the tokens of this step.

    Prefill packs the new tokens of every sequence back to back:

        tokens:        | seq0 new tokens | seq1 new tokens | ...
        cu_seqlens_q:  0                 5                 12     (new tokens, cumulative)
        cu_seqlens_k:  0                 5                 20     (all keys: cached + new)

    Decode has one new token per sequence and reads its keys through `block_tables`.

    A mixed step (chunked prefill) puts its decode rows first and its prompt chunks after them:

        tokens:        | d0 | d1 | d2 | chunk of p0 ......| chunk of p1 ...|
                        <- num_decode_tokens ->
        decode:        metadata of the decode rows (context_lens, block_tables, seq_order)
        cu_seqlens_q:                 0                   18               30   (the chunks only)
        cu_seqlens_k:                 0                   50               62   (cached prefix + chunk)

    A chunk that continues a cached prefix (an earlier chunk, or a prefix-cache hit) reads the
    prefix from the paged cache through `block_tables` and its own keys from this step's k/v.

    A unified mixed step (engine/model_runner.py, UNIFIED_MIXED_MAX_TOKENS) packs its decode rows
    as 1-token chunks over their cached context instead: num_decode_tokens = 0, no `decode`, and
    cu_seqlens_q steps by 1 over its first num_unified_decodes rows:

        tokens:        | d0 | d1 | d2 | chunk of p0 ......|
        cu_seqlens_q:  0    1    2    3                   21
        cu_seqlens_k:  0    40   57   90                  122   (context incl. the new token)
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int32: cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor | None = None  # [batch + 1] int32 (prefill)
    cu_seqlens_k: torch.Tensor | None = None  # [batch + 1] int32 (prefill)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # [batch, max_blocks] int32. Prefill: set only when some sequence has cached prefix tokens
    # (then keys are read from the paged cache). Decode: always set.
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None  # [batch] int32 (decode: keys in cache incl. new)
    seq_order: torch.Tensor | None = None  # [batch] int32 (decode): sequences longest first, for the kernel
    num_decode_tokens: int = 0  # prefill steps: the first tokens are decode rows (mixed step)
    decode: "AttentionMetadata | None" = None  # their metadata (is_prefill=False), when there are any
    # a unified mixed step: its first rows are decodes packed as 1-token chunks (attention treats
    # them as chunks; step counts tell the two kinds of mixed step apart by it)
    num_unified_decodes: int = 0


_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata):
    """Make `metadata` visible to the attention layers for the duration of one forward."""
    global _forward_context
    previous, _forward_context = _forward_context, metadata
    try:
        yield metadata
    finally:
        _forward_context = previous


_piece_capture = None  # the prompt-step graph capture in progress (engine/prompt_graphs.py), if any


@contextmanager
def capturing_pieces(capture):
    """While set, attention layers hand their q, k, v to `capture.cut(layer, q, k, v)` instead of
    attending: the piecewise CUDA-graph capture of prompt steps cuts the forward there."""
    global _piece_capture
    previous, _piece_capture = _piece_capture, capture
    try:
        yield capture
    finally:
        _piece_capture = previous


def get_piece_capture():
    return _piece_capture


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context(...): no step metadata")
    return _forward_context


def prefill_metadata(seq_lens: list[int], device="cpu") -> AttentionMetadata:
    """Metadata for a plain prefill of whole sequences with no KV cache (parity tests, warm-up)."""
    cu = torch.tensor([0] + list(_cumsum(seq_lens)), dtype=torch.int32, device=device)
    num_tokens = int(sum(seq_lens))
    return AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=device),
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(seq_lens), max_seqlen_k=max(seq_lens),
    )


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total
