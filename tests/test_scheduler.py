"""Scheduler scenarios on a fake config and a fake model that reads its context back from a fake KV cache.

The exact-step scenarios up to the chunked-prefill section run the core's Scheduler (a step is a
whole-prompt prefill or a decode); the chunked section checks ChunkedPrefillScheduler's exact token
budgets per step; the randomized workloads run both. They grade exercise 03.1 (_schedule_waiting
and _schedule_decodes); the known wrong answers at the end must fail them."""
import random
from types import SimpleNamespace

import pytest

from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import Sequence, SequenceStatus
from minivllm.engine.chunked_prefill import ChunkedPrefillScheduler
from minivllm.sampling_params import SamplingParams
from wrong_answers import builds_on_the_engine, case_id, rejected

EOS = 0
BS = 4


def make_config(**overrides):
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, kvcache_block_size=BS, num_kvcache_blocks=64,
                  enable_prefix_caching=True, eos_token_id=EOS, max_model_len=64)
    config.update(overrides)
    return SimpleNamespace(**config)


def make_seq(token_ids, **params):
    return Sequence(list(token_ids), SamplingParams(**{"ignore_eos": True, **params}), block_size=BS)


class FakeRunner:
    """Writes each computed token's "K/V" into its slot and predicts from what the cache holds.

    A real token's K/V depends on every token before it, so the fake K/V of position p is the
    whole prefix token_ids[:p + 1]. Reading it back checks every slot the block table points at.
    """

    def __init__(self, num_blocks, vocab_size=50):
        self.kv_cache = [None] * (num_blocks * BS)  # slot -> token id whose "K/V" is stored there
        self.vocab_size = vocab_size
        self.num_computed_tokens = 0

    def slot(self, seq, position):
        return seq.block_table[position // BS] * BS + position % BS

    def step(self, output):
        """Compute each scheduled chunk (it ends at seq.num_computed_tokens); return the next token
        of each sampled sequence."""
        token_ids = []
        sampled = {seq.seq_id for seq in output.sampled_seqs}
        for seq, num_tokens in zip(output.seqs, output.num_scheduled_tokens):
            end = seq.num_computed_tokens
            start = end - num_tokens
            assert 0 <= start < end <= seq.num_tokens
            for position in range(start, end):
                self.kv_cache[self.slot(seq, position)] = tuple(seq.token_ids[:position + 1])
            self.num_computed_tokens += num_tokens
            for p in range(end):
                assert self.kv_cache[self.slot(seq, p)] == tuple(seq.token_ids[:p + 1]), f"bad KV at position {p}"
            assert (seq.seq_id in sampled) == (end == seq.num_tokens), "sample exactly at the last token"
            if seq.seq_id in sampled:
                token_ids.append(sum((i + 1) * t for i, t in enumerate(seq.token_ids)) % self.vocab_size)
        assert [s.seq_id for s in output.seqs if s.seq_id in sampled] == [s.seq_id for s in output.sampled_seqs]
        return token_ids


def run_to_completion(scheduler, seqs):
    runner = FakeRunner(scheduler.kv_cache_manager.num_blocks)
    for seq in seqs:
        scheduler.add(seq)
    steps = []
    while not scheduler.is_finished():
        output = scheduler.schedule()
        assert output.num_seqs <= scheduler.max_num_seqs
        assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
        steps.append(output)
        scheduler.update_from_output(output, runner.step(output))
        assert len(steps) < 10_000, "scheduler is not making progress"
    return steps, runner


def test_prefill_then_decode_and_continuous_batching():
    scheduler = Scheduler(make_config())
    a, b = make_seq(range(1, 6), max_tokens=5), make_seq(range(10, 13), max_tokens=5)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [a, b] and out.num_batched_tokens == 8
    assert a.status == b.status == SequenceStatus.RUNNING
    assert scheduler.update_from_output(out, [7, 8]) == []
    assert a.completion_token_ids == [7] and b.last_token == 8
    out = scheduler.schedule()
    assert not out.is_prefill and out.seqs == [a, b] and out.num_batched_tokens == 2
    scheduler.update_from_output(out, [1, 1])
    c = make_seq([20, 21], max_tokens=5)
    scheduler.add(c)  # joins while a and b are decoding
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [c]
    scheduler.update_from_output(out, [3])
    out = scheduler.schedule()
    assert not out.is_prefill and out.seqs == [a, b, c]


def test_token_budget_counts_only_uncached_tokens():
    scheduler = Scheduler(make_config(max_num_batched_tokens=16, max_model_len=16))
    a = make_seq(range(1, 11))  # 10 tokens
    b = make_seq(list(range(1, 9)) + [90, 91])  # shares a's first two blocks: 2 new tokens
    c = make_seq(range(30, 40))  # 10 new tokens: over the budget this step
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a, b] and out.num_batched_tokens == 12 and out.num_cached_tokens == 8
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    scheduler.update_from_output(out, [1, 1])
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [c]


def test_max_num_seqs_bounds_the_running_set():
    scheduler = Scheduler(make_config(max_num_seqs=2))
    a, b, c = (make_seq([i + 1], max_tokens=2) for i in range(3))
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a, b]
    scheduler.update_from_output(out, [5, 5])
    out = scheduler.schedule()
    assert not out.is_prefill and out.seqs == [a, b]  # c waits for a seat
    assert scheduler.update_from_output(out, [5, 5]) == [a, b]
    assert a.finish_reason == b.finish_reason == "length"
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [c]


def test_admission_is_first_come_first_served():
    """A prompt that does not fit the budget left stops admission: a shorter one behind it waits too."""
    scheduler = Scheduler(make_config(max_num_batched_tokens=16, max_model_len=16))
    a, b, c = make_seq(range(1, 13)), make_seq(range(20, 30)), make_seq([40, 41])  # 12, 10 and 2 tokens
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a] and list(scheduler.waiting) == [b, c]  # c would fit the 4 tokens left, after b
    scheduler.update_from_output(out, [1])
    out = scheduler.schedule()
    assert out.is_prefill and out.seqs == [b, c] and out.num_batched_tokens == 12


@pytest.mark.parametrize("params, tokens, num_generated, reason", [
    (dict(ignore_eos=False), [5, EOS, 5], 2, "stop"),
    (dict(ignore_eos=True, max_tokens=3), [5, EOS, 5], 3, "length"),
    (dict(ignore_eos=False, min_tokens=3, max_tokens=5), [EOS, EOS, EOS, 5], 3, "stop"),
    (dict(stop_token_ids=[7], ignore_eos=True), [5, 7, 5], 2, "stop"),
    (dict(stop_token_ids=[7], min_tokens=2), [7, 7], 2, "stop"),
    (dict(max_tokens=2), [5, 5, 5], 2, "length"),
    (dict(max_tokens=100), [5] * 100, 64 - 10, "length"),  # max_model_len = 64
])
def test_finish_rules(params, tokens, num_generated, reason):
    scheduler = Scheduler(make_config())
    seq = Sequence(list(range(1, 11)), SamplingParams(**{"max_tokens": 10, **params}), block_size=BS)
    scheduler.add(seq)
    for token_id in tokens:
        out = scheduler.schedule()
        if scheduler.update_from_output(out, [token_id]):
            break
    assert seq.is_finished and seq.finish_reason == reason and seq.num_completion_tokens == num_generated
    assert scheduler.is_finished() and seq.block_table == []
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_preemption_puts_the_newest_at_the_front_of_waiting():
    # 3 blocks of 4 tokens; two sequences of 4 tokens each need a second block at their 5th token.
    scheduler = Scheduler(make_config(num_kvcache_blocks=3, max_model_len=12, max_num_batched_tokens=12))
    a, b = make_seq([1, 2, 3, 4], max_tokens=4), make_seq([5, 6, 7, 8], max_tokens=4)
    late = make_seq([9, 9, 9, 9, 9], max_tokens=1)  # needs 2 blocks
    for seq in (a, b):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a, b] and a.block_table == [0] and b.block_table == [1]
    scheduler.update_from_output(out, [1, 1])
    scheduler.add(late)
    out = scheduler.schedule()  # late does not fit; a takes the last block; b (the newest) is preempted
    assert not out.is_prefill and out.seqs == [a] and a.block_table == [0, 2]
    assert scheduler.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_cached_tokens == 0
    assert list(scheduler.waiting) == [b, late] and list(scheduler.running) == [a]
    assert scheduler.kv_cache_manager.pool.free_block_ids() == [1]
    scheduler.update_from_output(out, [2])
    for _ in range(2):  # b's 2 blocks (1 cached) do not fit until a finishes
        out = scheduler.schedule()
        assert out.seqs == [a] and not out.is_prefill
        finished = scheduler.update_from_output(out, [2])
    assert finished == [a] and a.num_completion_tokens == 4
    out = scheduler.schedule()  # b is re-prefilled over prompt + its generated token, its full block from cache
    assert out.is_prefill and out.seqs == [b] and b.block_table == [1, 2]
    assert b.num_cached_tokens == 4 and out.num_batched_tokens == 1 and out.num_cached_tokens == 4
    assert b.num_prompt_cached_tokens == 0  # the stat reports the first prefill


def test_the_newest_is_preempted_for_the_oldest():
    # 3 blocks of 4 tokens, three 4-token prompts: a block each, none left. At its 5th token each needs
    # a second block: a (the oldest) takes c's, then b finds none and, the newest left, preempts itself.
    scheduler = Scheduler(make_config(num_kvcache_blocks=3, max_model_len=12, max_num_batched_tokens=12))
    a, b, c = (make_seq(range(4 * i + 1, 4 * i + 5), max_tokens=2) for i in range(3))
    for seq in (a, b, c):
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [a, b, c] and [seq.block_table for seq in (a, b, c)] == [[0], [1], [2]]
    scheduler.update_from_output(out, [1, 1, 1])
    out = scheduler.schedule()
    assert not out.is_prefill and out.seqs == [a] and a.block_table == [0, 2]
    assert list(scheduler.running) == [a] and list(scheduler.waiting) == [b, c]  # admission order kept
    assert scheduler.num_preemptions == 2 and b.block_table == c.block_table == []
    assert b.status == c.status == SequenceStatus.WAITING and b.num_computed_tokens == c.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.pool.free_block_ids() == [1]  # b's block; c's went to a
    assert scheduler.update_from_output(out, [2]) == [a]
    out = scheduler.schedule()  # b comes back: its prompt's block from the cache, one token to compute
    assert out.is_prefill and out.seqs == [b] and out.num_batched_tokens == 1 and out.num_cached_tokens == 4
    assert b.block_table == [1, 2] and list(scheduler.waiting) == [c]  # c's block was recycled: 2 needed, 1 free


def test_a_sequence_that_can_never_fit_is_rejected():
    scheduler = Scheduler(make_config(num_kvcache_blocks=4))
    with pytest.raises(ValueError, match="needs? .*4 blocks|may need 5 KV blocks"):
        scheduler.add(make_seq(range(1, 18), max_tokens=1))  # 17 prompt tokens: 5 blocks
    with pytest.raises(ValueError, match="may need 5 KV blocks .* only 4"):
        scheduler.add(make_seq(range(1, 9), max_tokens=12))  # grows to 19 cached tokens
    scheduler.add(make_seq(range(1, 9), max_tokens=9))  # 16 cached tokens at most: fits exactly
    with pytest.raises(ValueError, match="max_model_len=64"):
        scheduler.add(make_seq(range(65)))
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 must be >= max_model_len=64"):
        Scheduler(make_config(max_num_batched_tokens=32))
    ChunkedPrefillScheduler(make_config(max_num_batched_tokens=32))  # chunks: fine


def test_finish_aborts_waiting_and_running():
    scheduler = Scheduler(make_config())
    a, b = make_seq([1, 2]), make_seq([3, 4])
    scheduler.add(a)
    out = scheduler.schedule()
    scheduler.add(b)
    scheduler.finish(a, "abort")
    scheduler.finish(b, "abort")
    assert a.is_finished and b.is_finished and scheduler.is_finished()
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    scheduler.finish(a, "stop")  # a stop string found after the fact only changes the reason
    assert a.finish_reason == "stop" and scheduler.kv_cache_manager.num_free_blocks == 64
    assert out.seqs == [a]


def random_workload(seed, num_seqs=12):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    prompts = [shared[:rng.randrange(0, 13)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
               for _ in range(num_seqs)]
    return [dict(token_ids=p, max_tokens=rng.randrange(1, 20), ignore_eos=rng.random() < 0.5) for p in prompts]


@pytest.mark.parametrize("chunked_budget", [None, 8, 13])
@pytest.mark.parametrize("seed", range(4))
def test_tiny_cache_and_no_prefix_cache_give_the_same_outputs(seed, chunked_budget):
    """Preemption, prefix caching and chunked prefill (budgets shorter than prompts, chunks that
    end mid-block) must never change what is generated."""
    def run(**overrides):
        scheduler_class = ChunkedPrefillScheduler if chunked_budget else Scheduler
        budget = dict(max_num_batched_tokens=chunked_budget or 40)
        scheduler = scheduler_class(make_config(max_model_len=40, **{**budget, **overrides}))
        seqs = [make_seq(**w) for w in random_workload(seed)]
        steps, runner = run_to_completion(scheduler, seqs)
        bm = scheduler.kv_cache_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.pool.blocks.values())
        scheduler.steps = steps
        return [s.completion_token_ids for s in seqs], scheduler, runner

    reference, big, big_runner = run(num_kvcache_blocks=200)
    if chunked_budget:
        assert any(len(step.seqs) > len(step.sampled_seqs) for step in big.steps), "no prompt was split"
        assert any(0 < step.num_decodes < len(step.seqs) for step in big.steps), "no mixed step"
    assert big.num_preemptions == 0 and big.kv_cache_manager.num_cached_tokens_hit > 0
    tiny_outputs, tiny, _ = run(num_kvcache_blocks=10)
    assert tiny_outputs == reference
    assert tiny.num_preemptions > 0
    uncached_outputs, uncached, uncached_runner = run(num_kvcache_blocks=200, enable_prefix_caching=False)
    assert uncached_outputs == reference
    assert uncached.kv_cache_manager.num_cached_tokens_hit == 0
    assert big_runner.num_computed_tokens < uncached_runner.num_computed_tokens  # caching saved work
    one_seat, _, _ = run(num_kvcache_blocks=200, max_num_seqs=1)
    assert one_seat == reference


# ---- chunked prefill: one token budget per step ----------------------------------------------------

def chunked(**overrides):
    return ChunkedPrefillScheduler(make_config(**overrides))


@pytest.mark.parametrize("chunked_on, async_on, spec", [(False, False, None), (True, False, None), (True, True, None),
                                                       (False, True, None), (True, True, {"method": "ngram"})])
def test_the_assembly_puts_chunked_prefill_over_the_core_scheduler_only_when_asked(chunked_on, async_on, spec):
    """The core's Scheduler knows nothing of chunks: the ChunkedPrefillScheduler layer is what splits
    prompts, and the assembly adds it (under async scheduling and speculation) only when it is on."""
    from minivllm.engine.assemble import scheduler_class
    from minivllm.engine.async_scheduling import AsyncScheduler
    from minivllm.engine.spec_decode import SpecDecodeScheduler

    config = SimpleNamespace(enable_chunked_prefill=chunked_on, async_scheduling=async_on, spec_config=spec)
    mro = scheduler_class(config).__mro__
    assert (ChunkedPrefillScheduler in mro) == chunked_on and (AsyncScheduler in mro) == async_on
    assert (SpecDecodeScheduler in mro) == (spec is not None) and mro[-2] is Scheduler
    assert "enable_chunked_prefill" not in vars(Scheduler) and mro[-2].prefill_size(None, 20, 10) == 0
    first_prefill_size = next(cls for cls in mro if "prefill_size" in vars(cls))
    assert first_prefill_size is (ChunkedPrefillScheduler if chunked_on else Scheduler)
    if spec is None:
        scheduler = scheduler_class(config)(make_config(max_num_batched_tokens=16, max_model_len=64 if chunked_on else 16))
        scheduler.add(make_seq(range(1, 41 if chunked_on else 17), max_tokens=1))
        assert scheduler.schedule().num_scheduled_tokens == [16]  # chunked: a 40-token prompt split at the budget


def step(scheduler, runner):
    """Schedule one step, compute it with the fake runner, postprocess; return the step's
    (seq, num_tokens) pairs."""
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    scheduler.update_from_output(out, runner.step(out))
    return [(seq, n) for seq, n in zip(out.seqs, out.num_scheduled_tokens)], out


def test_chunked_decodes_first_then_a_prompt_split_across_steps():
    scheduler = chunked(max_num_batched_tokens=16)
    runner = FakeRunner(64)
    decoders = [make_seq([i + 1, i + 2], max_tokens=10) for i in range(3)]
    for seq in decoders:
        scheduler.add(seq)
    pairs, out = step(scheduler, runner)  # three 2-token prompts in one step
    assert pairs == [(d, 2) for d in decoders] and out.num_decodes == 0
    p = make_seq(range(1, 21), max_tokens=10)  # 20 tokens: more than the 13 left after 3 decodes
    scheduler.add(p)
    pairs, out = step(scheduler, runner)
    assert pairs == [(d, 1) for d in decoders] + [(p, 13)]
    assert out.num_decodes == 3 and out.is_prefill and out.sampled_seqs == decoders
    assert p.num_computed_tokens == 13 and p.num_completion_tokens == 0 and p.status == SequenceStatus.RUNNING
    pairs, out = step(scheduler, runner)  # the rest of p, which then samples its first token
    assert pairs == [(d, 1) for d in decoders] + [(p, 7)] and out.sampled_seqs == decoders + [p]
    assert p.num_completion_tokens == 1 and p.num_uncomputed_tokens == 1
    pairs, out = step(scheduler, runner)
    assert pairs == [(d, 1) for d in decoders + [p]] and not out.is_prefill


def test_chunked_waiting_prompts_fill_what_the_running_chunk_leaves():
    scheduler = chunked(max_num_batched_tokens=8)
    runner = FakeRunner(64)
    a, b = make_seq(range(1, 21), max_tokens=3), make_seq(range(30, 35), max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler, runner)[0] == [(a, 8)]
    assert step(scheduler, runner)[0] == [(a, 8)]
    assert step(scheduler, runner)[0] == [(a, 4), (b, 4)]  # a finishes its prompt, b starts
    # a decodes; b's one remaining prompt token is computed like a decode (it samples b's first token)
    pairs, out = step(scheduler, runner)
    assert pairs == [(a, 1), (b, 1)] and out.num_decodes == 2 and out.sampled_seqs == [a, b]
    assert b.num_completion_tokens == 1
    assert step(scheduler, runner)[0] == [(a, 1), (b, 1)]


def test_chunked_prefix_hit_ends_mid_chunk_and_blocks_register_when_filled():
    scheduler = chunked(max_num_batched_tokens=6)
    runner = FakeRunner(64)
    bm = scheduler.kv_cache_manager
    a = make_seq(range(1, 11), max_tokens=1)  # 10 tokens: blocks [1-4][5-8][9 10]
    scheduler.add(a)
    assert step(scheduler, runner)[0] == [(a, 6)]  # tokens 0-5: block 0 full, block 1 half
    assert [bm.pool.block(i).hash is not None for i in a.block_table] == [True, False, False]
    assert step(scheduler, runner)[0] == [(a, 4)]  # 6-9: block 1 full; a finishes (max_tokens 1)
    assert a.is_finished
    b = make_seq(list(range(1, 9)) + [50, 51, 52, 53, 54], max_tokens=1)  # 13 tokens, 8 cached
    scheduler.add(b)
    pairs, out = step(scheduler, runner)
    assert pairs == [(b, 5)] and out.num_cached_tokens == 8 and b.num_prompt_cached_tokens == 8
    assert b.is_finished


def test_chunked_preemption_mid_prefill():
    # 6 blocks of 4, budget 5. d (5 tokens) decodes; p (16 tokens, 4 blocks) is prefilled 4 tokens
    # per step beside it. When d's 9th token needs a third block, none is free: p, the newest,
    # is preempted mid-prefill, and comes back later with the blocks its chunks had filled.
    scheduler = chunked(max_num_batched_tokens=5, num_kvcache_blocks=6, max_model_len=24)
    runner = FakeRunner(6)
    bm = scheduler.kv_cache_manager
    d = make_seq([1, 2, 3, 4, 5], max_tokens=6)
    scheduler.add(d)
    assert step(scheduler, runner)[0] == [(d, 5)]  # d: 2 blocks
    p = make_seq(range(10, 26), max_tokens=2)
    scheduler.add(p)
    assert step(scheduler, runner)[0] == [(d, 1), (p, 4)]  # p takes the last 4 blocks
    assert bm.num_free_blocks == 0
    assert step(scheduler, runner)[0] == [(d, 1), (p, 4)]
    assert step(scheduler, runner)[0] == [(d, 1), (p, 4)]
    assert p.num_computed_tokens == 12 and sum(bm.pool.block(b).hash is not None for b in p.block_table) == 3
    pairs, _ = step(scheduler, runner)  # d's 9th token: preempt p; nothing is admitted this step
    assert pairs == [(d, 1)] and scheduler.num_preemptions == 1
    assert p.status == SequenceStatus.WAITING and p.block_table == [] and p.num_computed_tokens == 0
    assert list(scheduler.waiting) == [p] and bm.num_free_blocks == 3
    assert step(scheduler, runner)[0] == [(d, 1)]  # p needs 4 free blocks (its 3 cached ones are free): 3
    assert d.is_finished  # 6 tokens generated
    pairs, out = step(scheduler, runner)  # p comes back: 12 tokens from the cache, its last 4 computed
    assert pairs == [(p, 4)] and out.num_cached_tokens == 12 and p.num_cached_tokens == 12
    assert p.num_prompt_cached_tokens == 0  # the stat reports the first admission
    assert step(scheduler, runner)[0] == [(p, 1)]
    assert scheduler.is_finished() and bm.num_free_blocks == 6


# ------------------------------------------------------------------------------------------------
# Known wrong answers: each must fail the tests that grade exercise 03.1
# ------------------------------------------------------------------------------------------------

def decodes_that_preempt_themselves(self):
    """Preempts the sequence whose token finds no block, not the newest: the oldest loses its work."""
    scheduled = []
    for seq in [s for s in self.running if not s.is_prefilling]:
        if self.kv_cache_manager.allocate_slots(seq, 1):
            self._schedule_tokens(seq, 1)
            scheduled.append(seq)
        else:
            self.running.remove(seq)
            self.preempt(seq)
    return scheduled


def decodes_that_wait_for_blocks(self):
    """Never preempts: a sequence without a block skips the step, and when none has one, nothing runs."""
    scheduled = []
    for seq in [s for s in self.running if not s.is_prefilling]:
        if self.kv_cache_manager.allocate_slots(seq, 1):
            self._schedule_tokens(seq, 1)
            scheduled.append(seq)
    return scheduled


def admits_nobody(self, budget):
    """The trivial answer: nothing is ever admitted."""
    return []


def _admission(self, budget, *, over_the_budget=False, over_the_seats=False, charges_cached_tokens=False,
               jumps_the_queue=False):
    """The engine's _schedule_waiting, with one thing broken by each keyword."""
    admitted, passed_over = [], []
    while self.waiting and (over_the_seats or len(self.running) < self.max_num_seqs) and (over_the_budget or budget > 0):
        seq = self.waiting[0]
        computed = self.kv_cache_manager.get_computed_blocks(seq)
        num_new_tokens = seq.num_tokens - computed.num_tokens
        cost = seq.num_tokens if charges_cached_tokens else num_new_tokens
        fits = over_the_budget or self.prefill_size(cost, budget) > 0
        num_tokens = num_new_tokens if over_the_budget else min(num_new_tokens, budget)
        if not (fits and self.kv_cache_manager.allocate_slots(seq, num_new_tokens, computed)):
            if not jumps_the_queue:
                break
            passed_over.append(self.waiting.popleft())
            continue
        seq.num_cached_tokens = seq.num_computed_tokens = computed.num_tokens
        if seq.num_prompt_cached_tokens is None:
            seq.num_prompt_cached_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.waiting.popleft()
        self.running.append(seq)
        self._schedule_tokens(seq, num_tokens)
        budget -= cost if charges_cached_tokens else num_tokens
        admitted.append(seq)
    self.waiting.extendleft(reversed(passed_over))
    return admitted


def broken(**broken_keyword):
    def _schedule_waiting(self, budget):
        return _admission(self, budget, **broken_keyword)
    _schedule_waiting.__name__ = "waiting_" + "_".join(broken_keyword)
    return _schedule_waiting


ADMISSION_CHECKS = [test_prefill_then_decode_and_continuous_batching, test_token_budget_counts_only_uncached_tokens,
                    test_max_num_seqs_bounds_the_running_set, test_admission_is_first_come_first_served,
                    test_chunked_decodes_first_then_a_prompt_split_across_steps,
                    test_chunked_prefix_hit_ends_mid_chunk_and_blocks_register_when_filled]


@builds_on_the_engine
def test_the_admission_as_the_wrong_answers_write_it_passes():
    """_admission with nothing broken is right: each wrong answer below differs from it in one thing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "_schedule_waiting", broken())
        for check in ADMISSION_CHECKS:
            check()


@builds_on_the_engine
@pytest.mark.parametrize("name, wrong, check", [
    ("_schedule_decodes", decodes_that_preempt_themselves, test_the_newest_is_preempted_for_the_oldest),
    ("_schedule_decodes", decodes_that_wait_for_blocks, test_the_newest_is_preempted_for_the_oldest),
    ("_schedule_decodes", decodes_that_wait_for_blocks, test_preemption_puts_the_newest_at_the_front_of_waiting),
    ("_schedule_waiting", admits_nobody, test_prefill_then_decode_and_continuous_batching),
    ("_schedule_waiting", broken(over_the_budget=True), test_token_budget_counts_only_uncached_tokens),
    ("_schedule_waiting", broken(over_the_budget=True), test_chunked_decodes_first_then_a_prompt_split_across_steps),
    ("_schedule_waiting", broken(over_the_seats=True), test_max_num_seqs_bounds_the_running_set),
    ("_schedule_waiting", broken(charges_cached_tokens=True), test_token_budget_counts_only_uncached_tokens),
    ("_schedule_waiting", broken(jumps_the_queue=True), test_admission_is_first_come_first_served),
], ids=case_id)
def test_the_scheduler_checks_reject_a_wrong_schedule(name, wrong, check):
    rejected(check, Scheduler, name, wrong)
