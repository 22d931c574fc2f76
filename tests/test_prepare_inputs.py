"""ModelRunner.prepare_prefill: one step's tokens packed back to back, with the cache slot of each,
the sequences' boundaries, the rows that sample and the zero-padded block tables; prepare_decode: one
new token per sequence, its slot, the context lengths and the rows longest first; exact arrays and
dtypes. They grade exercise 02.1 (prepare_prefill, prepare_decode, _slots, _block_tables); the known
wrong answers at the end must fail them.
"""
import dataclasses

import numpy as np
import pytest

from minivllm.core.model_runner import ModelRunner
from minivllm.core.sequence import Sequence
from wrong_answers import builds_on_the_engine, rejected

BS = 4  # block size
WIDTH = 5  # blocks per block-table row (the runner's max_num_blocks_per_seq)


def make_runner():
    """A ModelRunner without a model: packing a step reads only the block size and the table width."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.max_num_blocks_per_seq = BS, WIDTH
    return runner


def make_seq(num_tokens, block_table, num_computed_tokens):
    """A sequence whose scheduled step ends at num_computed_tokens (the scheduler counted it already)."""
    seq = Sequence(list(range(100, 100 + num_tokens)), block_size=BS)
    seq.block_table, seq.num_computed_tokens = list(block_table), num_computed_tokens
    return seq


def assert_arrays(inputs, **expected):
    for name, (values, dtype) in expected.items():
        actual = getattr(inputs, name)
        assert isinstance(actual, np.ndarray) and actual.dtype == dtype, (
            f"{name}: {type(actual).__name__} {getattr(actual, 'dtype', '')}, expected a {np.dtype(dtype)} array")
        assert actual.tolist() == values, f"{name}: {actual.tolist()}, expected {values}"


def test_two_whole_prompts():
    """Prompts of 7 and 3 tokens in blocks [5, 2] and [7]: slots block by block, each prompt samples
    at its last token."""
    a, b = make_seq(7, [5, 2], 7), make_seq(3, [7], 3)
    inputs = make_runner().prepare_prefill([a, b], [7, 3])
    assert_arrays(
        inputs,
        input_ids=(a.token_ids + b.token_ids, np.int64),
        positions=([0, 1, 2, 3, 4, 5, 6, 0, 1, 2], np.int64),
        slot_mapping=([20, 21, 22, 23, 8, 9, 10, 28, 29, 30], np.int32),
        cu_seqlens_q=([0, 7, 10], np.int32),
        cu_seqlens_k=([0, 7, 10], np.int32),
        logits_indices=([6, 9], np.int64),
        block_tables=([[5, 2, 0, 0, 0], [7, 0, 0, 0, 0]], np.int32),
    )
    assert (inputs.is_prefill, inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.has_prefix, inputs.num_decodes) == (
        True, 7, 7, False, 0)


def test_chunks_after_a_prefix_and_a_chunk_that_does_not_sample():
    """A prompt of 10 whose first 6 tokens are cached (blocks [3, 8, 1]) computes tokens 6-9; a prompt of
    9 computes its first chunk, 0-3, and does not sample yet."""
    c, d = make_seq(10, [3, 8, 1], 10), make_seq(9, [6, 4, 9], 4)
    inputs = make_runner().prepare_prefill([c, d], [4, 4])
    assert_arrays(
        inputs,
        input_ids=(c.token_ids[6:] + d.token_ids[:4], np.int64),
        positions=([6, 7, 8, 9, 0, 1, 2, 3], np.int64),
        slot_mapping=([34, 35, 4, 5, 24, 25, 26, 27], np.int32),
        cu_seqlens_q=([0, 4, 8], np.int32),
        cu_seqlens_k=([0, 10, 14], np.int32),
        logits_indices=([3], np.int64),
        block_tables=([[3, 8, 1, 0, 0], [6, 4, 9, 0, 0]], np.int32),
    )
    assert (inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.has_prefix) == (4, 10, True)


def test_a_mixed_step_and_a_forward_that_stores_nothing():
    """A decode row first (one token, position 12, in its table's fourth block), then a whole prompt;
    use_cache=False (a warm-up) gives every token slot -1."""
    e, f = make_seq(13, [2, 0, 3, 1], 13), make_seq(2, [4], 2)
    inputs = make_runner().prepare_prefill([e, f], [1, 2], num_decodes=1)
    assert_arrays(inputs, input_ids=([e.token_ids[-1]] + f.token_ids, np.int64), positions=([12, 0, 1], np.int64),
                  slot_mapping=([4, 16, 17], np.int32), cu_seqlens_q=([0, 1, 3], np.int32),
                  cu_seqlens_k=([0, 13, 15], np.int32), logits_indices=([0, 2], np.int64),
                  block_tables=([[2, 0, 3, 1, 0], [4, 0, 0, 0, 0]], np.int32))
    assert (inputs.num_decodes, inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.has_prefix) == (1, 2, 13, True)
    warm_up = make_runner().prepare_prefill([make_seq(6, [], 6)], [6], use_cache=False)
    assert_arrays(warm_up, slot_mapping=([-1] * 6, np.int32), logits_indices=([5], np.int64),
                  block_tables=([[0] * WIDTH], np.int32))


def test_a_decode_step():
    """Four sequences of 13, 2, 8 and 8 tokens: each new token is its last, at position num_tokens - 1,
    in that position's slot; the rows by context length, longest first, ties in row order."""
    a, b, c, d = make_seq(13, [2, 0, 3, 1], 12), make_seq(2, [4], 1), make_seq(8, [6, 5], 7), make_seq(8, [7, 9], 7)
    inputs = make_runner().prepare_decode([a, b, c, d])
    assert_arrays(
        inputs,
        input_ids=([a.last_token, b.last_token, c.last_token, d.last_token], np.int64),
        positions=([12, 1, 7, 7], np.int64),
        slot_mapping=([4, 17, 23, 39], np.int32),
        logits_indices=([0, 1, 2, 3], np.int64),
        block_tables=([[2, 0, 3, 1, 0], [4, 0, 0, 0, 0], [6, 5, 0, 0, 0], [7, 9, 0, 0, 0]], np.int32),
        context_lens=([13, 2, 8, 8], np.int32),
        seq_order=([0, 2, 3, 1], np.int32),
    )
    assert (inputs.is_prefill, inputs.num_decodes, inputs.cu_seqlens_q) == (False, 4, None)


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail a check that grades exercise 02.1
# ------------------------------------------------------------------------------------------------

engine_prepare_prefill = ModelRunner.prepare_prefill
engine_prepare_decode = ModelRunner.prepare_decode


def _replaced(**fields):
    """The engine's prepare_prefill with some fields computed otherwise: fields maps a name to
    f(inputs, seqs, num_scheduled_tokens)."""
    def prepare_prefill(self, seqs, num_scheduled_tokens, num_decodes=0, use_cache=True):
        inputs = engine_prepare_prefill(self, seqs, num_scheduled_tokens, num_decodes, use_cache)
        return dataclasses.replace(inputs, **{name: f(inputs, seqs, num_scheduled_tokens)
                                              for name, f in fields.items()})
    return prepare_prefill


def slots_without_the_block_table(inputs, seqs, num_scheduled_tokens):
    """Slot = position: as if every sequence's blocks were 0, 1, 2, ... of its own cache."""
    return inputs.positions.astype(np.int32)


def slots_from_the_chunk_start(inputs, seqs, num_scheduled_tokens):
    """Counts a chunk's tokens from 0: a chunk after a prefix overwrites the prefix's slots."""
    return np.concatenate([np.asarray(seq.block_table)[np.arange(n) // BS] * BS + np.arange(n) % BS
                           for seq, n in zip(seqs, num_scheduled_tokens)]).astype(np.int32)


def every_sequence_samples(inputs, seqs, num_scheduled_tokens):
    return inputs.cu_seqlens_q[1:].astype(np.int64) - 1


def keys_of_this_step_only(inputs, seqs, num_scheduled_tokens):
    """cu_seqlens_k counts the chunk's tokens: the kernel never sees the prefix."""
    return inputs.cu_seqlens_q.copy()


def tables_as_wide_as_the_longest(inputs, seqs, num_scheduled_tokens):
    """A width that changes from step to step (a kernel is compiled per width class)."""
    width = max(len(seq.block_table) for seq in seqs)
    return np.array([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs], dtype=np.int32)


def tables_as_int64(inputs, seqs, num_scheduled_tokens):
    return inputs.block_tables.astype(np.int64)


def _replaced_decode(**fields):
    """The engine's prepare_decode with some fields computed otherwise: fields maps a name to
    f(inputs, seqs)."""
    def prepare_decode(self, seqs):
        inputs = engine_prepare_decode(self, seqs)
        return dataclasses.replace(inputs, **{name: f(inputs, seqs) for name, f in fields.items()})
    return prepare_decode


def decode_as_a_prefill_of_one_token(self, seqs):
    """The trivial answer: a decode is a prefill of each sequence's last token (no context lengths,
    no order)."""
    return engine_prepare_prefill(self, seqs, [1] * len(seqs), num_decodes=len(seqs))


def decode_slots_of_the_next_position(inputs, seqs):
    """Position num_tokens's slot, not num_tokens - 1's: the K/V lands where the next token's belongs."""
    return inputs.slot_mapping + 1


def decode_rows_in_batch_order(inputs, seqs):
    return np.arange(len(seqs), dtype=np.int32)


def decode_context_without_the_new_token(inputs, seqs):
    return inputs.context_lens - 1


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (decode_as_a_prefill_of_one_token, test_a_decode_step),
    (_replaced_decode(slot_mapping=decode_slots_of_the_next_position), test_a_decode_step),
    (_replaced_decode(seq_order=decode_rows_in_batch_order), test_a_decode_step),
    (_replaced_decode(context_lens=decode_context_without_the_new_token), test_a_decode_step),
], ids=["decode_as_a_prefill_of_one_token", "decode_slots_of_the_next_position", "decode_rows_in_batch_order",
        "decode_context_without_the_new_token"])
def test_the_packing_checks_reject_a_wrong_prepare_decode(wrong, check):
    rejected(check, ModelRunner, "prepare_decode", wrong)


@builds_on_the_engine
@pytest.mark.parametrize("wrong, check", [
    (_replaced(slot_mapping=slots_without_the_block_table), test_two_whole_prompts),
    (_replaced(slot_mapping=slots_from_the_chunk_start), test_chunks_after_a_prefix_and_a_chunk_that_does_not_sample),
    (_replaced(logits_indices=every_sequence_samples), test_chunks_after_a_prefix_and_a_chunk_that_does_not_sample),
    (_replaced(cu_seqlens_k=keys_of_this_step_only), test_chunks_after_a_prefix_and_a_chunk_that_does_not_sample),
    (_replaced(block_tables=tables_as_wide_as_the_longest), test_two_whole_prompts),
    (_replaced(block_tables=tables_as_int64), test_a_mixed_step_and_a_forward_that_stores_nothing),
], ids=["slots_without_the_block_table", "slots_from_the_chunk_start", "every_sequence_samples",
        "keys_of_this_step_only", "tables_as_wide_as_the_longest", "tables_as_int64"])
def test_the_packing_checks_reject_a_wrong_prepare_prefill(wrong, check):
    rejected(check, ModelRunner, "prepare_prefill", wrong)
