"""How a mixed step (decode rows + prompt chunks, chunked prefill) attends: one launch or two.

    unified (the core's way): each decode row is a 1-token chunk whose prefix is all in the paged
             cache; the whole step is one prefill-kernel launch per layer.
    split:   the decode rows through the decode kernel (and its split-K merge), the chunks through
             the prefill kernel, the two outputs concatenated: three or four launches.

Unified saves the decode, merge and cat launches of every layer: host time, which is most of a small
mixed step. But the prefill kernel gives each decode row a query tile of its own and reads its whole
context in one program, so its GPU time grows with decode rows x context: on an H200, 64 decode rows
of 2048 tokens of context + a 2048-token chunk took 0.634 ms per layer unified against 0.301 ms split
(benchmarks/bench_prefill.py, the ours_unified row). So this ModelRunner layer splits the mixed steps
of more than UNIFIED_MIXED_MAX_TOKENS tokens (Config.mixed_step_attention "auto"), or every one
("split"); "unified" leaves the core's way alone (the layer is not installed).
vLLM: vllm/v1/attention/backends/ (split_decodes_and_prefills).
"""
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.core.attention import AttentionMetadata
from minivllm.core.device import to_device
from minivllm.core.model_runner import StepInputs

UNIFIED_MIXED_MAX_TOKENS = 512


@dataclass
class SplitMixedMetadata(AttentionMetadata):
    """The chunks' varlen metadata (the fields of AttentionMetadata over the chunks only, but the
    slots of every token: the store covers the whole step), and the decode rows' own, which come
    first in the packed step."""

    num_decode_tokens: int = 0
    decode: AttentionMetadata | None = None


class SplitMixedAttention:
    """An attention backend that runs a SplitMixedMetadata step's decode rows and chunks apart."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def attend(self, layer, q, k, v, meta):
        if not isinstance(meta, SplitMixedMetadata):
            return self.inner.attend(layer, q, k, v, meta)
        n = meta.num_decode_tokens
        return torch.cat([self.inner.decode(layer, q[:n], meta.decode),
                          self.inner.prefill(layer, q[n:], k[n:], v[n:], meta)])


class SplitMixedSteps:
    """ModelRunner layer: large mixed steps get SplitMixedMetadata (`upload`), and every attention
    layer a backend that reads it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for layer in self.attention_layers:
            layer.backend = SplitMixedAttention(layer.backend)

    def is_unified_mixed_step(self, out) -> bool:
        """Does this mixed step run its decode rows as 1-token chunks (one launch)?"""
        return self.config.mixed_step_attention == "auto" and out.num_batched_tokens <= UNIFIED_MIXED_MAX_TOKENS

    def upload(self, inputs: StepInputs):
        batch = super().upload(inputs)
        split = inputs.is_prefill and inputs.num_decodes and (
            self.config.mixed_step_attention == "split" or inputs.num_tokens > UNIFIED_MIXED_MAX_TOKENS)
        if split:
            batch.attn = self._split_metadata(inputs, batch.attn.slot_mapping)
        return batch

    def _split_metadata(self, inputs: StepInputs, slot_mapping: torch.Tensor) -> SplitMixedMetadata:
        n, dev = inputs.num_decodes, lambda x: to_device(x, None, self.device)  # noqa: E731
        context_lens = np.diff(inputs.cu_seqlens_k[:n + 1]).astype(np.int32)
        decode = AttentionMetadata(False, slot_mapping[:n], block_tables=dev(inputs.block_tables[:n]),
                                   context_lens=dev(context_lens),
                                   seq_order=dev(np.argsort(-context_lens, kind="stable").astype(np.int32)))
        cu_q = (inputs.cu_seqlens_q[n:] - inputs.cu_seqlens_q[n]).astype(np.int32)
        cu_k = (inputs.cu_seqlens_k[n:] - inputs.cu_seqlens_k[n]).astype(np.int32)
        has_prefix = bool((np.diff(cu_k) > np.diff(cu_q)).any())
        return SplitMixedMetadata(True, slot_mapping, dev(cu_q), dev(cu_k), int(np.diff(cu_q).max()),
                                  int(np.diff(cu_k).max()), dev(inputs.block_tables[n:]) if has_prefix else None,
                                  num_decode_tokens=n, decode=decode)
