"""Speculative decoding's draft-model proposer: a second, smaller model with the target's tokenizer
guesses the next k tokens one at a time, greedily, from a paged KV cache of its own.

    per step, one batch for every sequence that may draft:
        catch up   feed the tokens the draft has not seen (the whole prompt the first time; then the
                   target's token of the last step, after any drafts the target rejected): its
                   argmax after the last one is d1
        k - 1 x    a decode step of d_j at its position -> d_(j+1)
    the draft's cache (its own blocks and block tables, the target's block size) keeps the KV of every
    token it was fed; the next step reuses the longest prefix that still equals the sequence, so
    accepted drafts are not fed again and rejected ones are overwritten

A catch-up of a few tokens per sequence runs as decode rows (one per token, as the target verifies),
so every draft forward but a prompt's first replays a decode CUDA graph on a GPU; the argmax stays
on the device from one draft step to the next (one host sync for all k). The drafts are greedy (q is
one-hot), so the rejection rule treats them as it treats n-gram drafts, and the output distribution
is the target's exactly.
vLLM: vllm/v1/spec_decode/draft_model.py.
"""
import logging
import os
from dataclasses import replace

import numpy as np
import torch

from minivllm.config import Config
from minivllm.core.device import to_device
from minivllm.core.kv_cache_manager import BlockPool

logger = logging.getLogger("minivllm")


class _DraftSeq:
    """A sequence in the draft's cache: its block table, and the tokens (positions 0..) whose KV the
    cache holds."""

    def __init__(self):
        self.block_table: list[int] = []
        self.cached: list[int] = []


class _Chunk:
    """A sequence's tokens to feed, as the runner's prepare_prefill reads it (the step ends at
    num_computed_tokens)."""

    def __init__(self, token_ids: list[int], block_table: list[int]):
        self.token_ids = token_ids
        self.num_computed_tokens = self.num_tokens = len(token_ids)
        self.block_table = block_table


class DraftModelProposer:
    """Drafts from `speculative_config["model"]` (see the module docstring)."""

    def __init__(self, config: Config):
        from minivllm.engine.assemble import build_model_runner
        from minivllm.engine.spec_decode import _DecodeRow

        self._row = _DecodeRow
        self.k = config.spec_config.num_speculative_tokens
        self.block_size = config.kvcache_block_size
        draft_config = make_draft_config(config)
        self.runner = build_model_runner(draft_config, torch.device(draft_config.device))
        self.pool = BlockPool(self.runner.num_kvcache_blocks)
        self.seqs: dict[int, _DraftSeq] = {}
        logger.info("draft model %s: %d KV blocks of its own", draft_config.model, self.runner.num_kvcache_blocks)

    @torch.inference_mode()
    def propose_batch(self, seqs, rooms: list[int]) -> list[list[int]]:
        """Up to rooms[i] greedy draft tokens for each of `seqs` ([] where the draft's cache is full)."""
        feeds, kept = [], []
        for seq, room in zip(seqs, rooms):
            state = self.seqs.setdefault(seq.seq_id, _DraftSeq())
            tokens = seq.token_ids
            reuse = _common_prefix(state.cached, tokens, len(tokens) - 1)  # the last token is always fed
            del state.cached[reuse:]
            if self._grow(state, len(tokens) + room - 1):  # every token, and d1..d(room-1) fed back
                feeds.append((state, tokens[reuse:], room))
                kept.append(True)
            else:
                kept.append(False)
        drafts = iter(self._draft(feeds) if feeds else [])
        return [next(drafts) if ok else [] for ok in kept]

    def _draft(self, feeds) -> list[list[int]]:
        runner, n = self.runner, len(feeds)
        longest = max(len(new) for _, new, _ in feeds)
        last_rows = np.cumsum([len(new) for _, new, _ in feeds]) - 1  # (rows are packed sequence by sequence)
        if longest <= 1 + self.k and last_rows[-1] < runner.max_decode_rows():
            rows = [self._row(state, len(state.cached) + i, t) for state, new, _ in feeds for i, t in enumerate(new)]
            batch = runner.upload(runner.prepare_decode(rows))
        else:  # a prompt (or a long catch-up): one prefill-style forward
            chunks = [_Chunk(state.cached + new, state.block_table) for state, new, _ in feeds]
            batch = runner.upload(runner.prepare_prefill(chunks, [len(new) for _, new, _ in feeds]))
        events = [_uploaded(batch)]
        hidden = runner.forward(batch)
        current = self._argmax(hidden[to_device(last_rows, torch.int64, hidden.device)])
        for state, new, _ in feeds:
            state.cached += new
        steps, active = [current], list(range(n))
        for j in range(1, max(room for _, _, room in feeds)):
            if len(events) >= 2 and events[-2] is not None:  # (two pinned host buffers: the one reused now must be sent)
                events[-2].synchronize()
            still = [i for i in active if feeds[i][2] > j]
            prev = current if len(still) == len(active) else current[to_device(
                [active.index(i) for i in still], torch.int64, current.device)]
            active = still
            rows = [self._row(feeds[i][0], len(feeds[i][0].cached) + j - 1, 0) for i in active]
            batch = runner.upload(runner.prepare_decode(rows))
            batch.input_ids[:len(active)].copy_(prev, non_blocking=True)  # d_j, still on the device
            events.append(_uploaded(batch))
            current = self._argmax(runner.forward(batch)[:len(active)])
            steps.append(current)
        drafts = [[] for _ in feeds]
        active = list(range(n))
        for j, ids in enumerate(_split(steps)):
            active = [i for i in active if feeds[i][2] > j]
            for i, token in zip(active, ids):
                drafts[i].append(token)
        for (state, _, _), d in zip(feeds, drafts):
            state.cached += d[:-1]  # d1..d(room-1) were fed (their KV written); the last was not
        return drafts

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft token of each row (the LM head alone: no sampler, no logprobs)."""
        return self.runner.model.compute_logits(hidden).argmax(dim=-1)

    def _grow(self, state: _DraftSeq, num_tokens: int) -> bool:
        """Blocks in state's table for num_tokens tokens; False if the draft's cache has too few."""
        need = -(-num_tokens // self.block_size) - len(state.block_table)
        if need > self.pool.num_free_blocks:
            return False
        state.block_table += [self.pool.allocate() for _ in range(max(need, 0))]
        return True

    def forget_except(self, running) -> None:
        """Free the draft blocks of every sequence that no longer runs (finished, aborted, preempted)."""
        live = {seq.seq_id for seq in running}
        for seq_id in [s for s in self.seqs if s not in live]:
            self.forget(seq_id)

    def forget(self, seq_id) -> None:
        """Free seq_id's draft blocks, if it has any."""
        state = self.seqs.pop(seq_id, None)
        for block_id in state.block_table if state is not None else ():
            self.pool.release(block_id)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None


def _uploaded(batch) -> "torch.cuda.Event | None":
    """An event behind this step's upload (on a GPU), so the host knows when its buffer is free again."""
    if not batch.input_ids.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _split(steps: list[torch.Tensor]) -> list[list[int]]:
    """Each draft step's argmax ids on the host (one sync: the first .tolist() waits for them all)."""
    flat = torch.cat(steps).tolist()
    out, start = [], 0
    for ids in steps:
        out.append(flat[start:start + len(ids)])
        start += len(ids)
    return out


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def make_draft_config(config: Config) -> Config:
    """The draft's engine config: the target's device, dtype, block size, lengths and kernels; as many
    KV blocks as the target's (as many tokens), fewer if the device has not the memory; never tensor
    parallel (the draft runs on rank 0's device)."""
    c = config.spec_config
    rows = min(config.max_num_seqs * (1 + c.num_speculative_tokens), config.max_num_batched_tokens, 512)
    draft = Config(c.model, dtype=config.torch_dtype, device=config.device, max_model_len=config.max_model_len,
                   max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_model_len),
                   max_num_seqs=max(rows, config.max_num_seqs),
                   kvcache_block_size=config.kvcache_block_size, enforce_eager=config.enforce_eager,
                   attention_backend=config.attention_backend, async_scheduling=False,
                   enable_prefix_caching=False, enable_chunked_prefill=False, seed=config.seed,
                   skip_tokenizer_init=True, num_kvcache_blocks=config.num_kvcache_blocks or 1)
    check_same_vocabulary(config, draft)
    if draft.device.startswith("cuda"):
        hf = draft.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        block_bytes = (2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * config.kvcache_block_size
                       * draft.kv_cache_torch_dtype.itemsize)
        free = torch.cuda.mem_get_info(torch.device(draft.device))[0]
        fits = int(free * 0.5 // block_bytes)  # half of what is free: the draft's weights and graphs need the rest
        min_blocks = -(-(config.max_model_len + 1) // config.kvcache_block_size)
        if fits < min_blocks:
            raise ValueError(f"the draft model's KV cache does not fit: {free / 2**30:.1f} GiB is free after the "
                             f"target's; lower gpu_memory_utilization to leave room for the draft")
        draft = replace(draft, num_kvcache_blocks=min(draft.num_kvcache_blocks, fits))
    return draft


def check_same_vocabulary(target: Config, draft: Config) -> None:
    """A draft proposes token ids of the target's vocabulary: same size, same tokenizer."""
    t, d = target.hf_config.vocab_size, draft.hf_config.vocab_size
    if t != d:
        raise ValueError(f"the draft model's vocabulary ({d} ids) differs from the target's ({t}): a draft "
                         f"model must share the target's tokenizer")
    target_vocab, draft_vocab = _tokenizer_vocab(target.tokenizer), _tokenizer_vocab(draft.model)
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        raise ValueError(f"the draft model's tokenizer ({draft.model}) differs from the target's "
                         f"({target.tokenizer}): a draft model must share the target's tokenizer")


def _tokenizer_vocab(path: str) -> dict | None:
    """The token -> id table of a directory's tokenizer.json (None without one)."""
    import json

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    vocab = dict(data.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return vocab
