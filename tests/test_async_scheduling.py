"""The async-scheduling layer on its own: the AsyncScheduler's one hook (a decode whose last token is
still a placeholder gets its block but not its hash) and the stepper's overlap of decode steps,
against a fake executor. The engine-level check that outputs are identical with async scheduling
on and off is tests/test_engine.py::test_async_scheduling_gives_the_same_outputs."""
from types import SimpleNamespace

from minivllm.core.model_runner import ModelRunnerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.core.sequence import Sequence
from minivllm.engine.async_scheduling import PLACEHOLDER_TOKEN_ID, AsyncScheduler, AsyncStepper
from minivllm.sampling_params import SamplingParams

BS = 4


def make_config(**overrides):
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, kvcache_block_size=BS, num_kvcache_blocks=16,
                  enable_prefix_caching=True, eos_token_id=0, max_model_len=64)
    config.update(overrides)
    return SimpleNamespace(**config)


def make_seq(token_ids, max_tokens=16):
    return Sequence(list(token_ids), SamplingParams(ignore_eos=True, max_tokens=max_tokens), block_size=BS)


def prefill(scheduler, seq):
    scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == [seq] and out.is_prefill


def test_a_placeholder_that_fills_a_block_defers_its_hash():
    """Prompt of 3 tokens + 1 sampled token fills block 0. Synchronous: the decode that writes the
    token's KV registers the block. Async with the token still a placeholder: the decode opens no
    block and registers nothing, until the token is known and the stepper registers it."""
    sync, overlapped = Scheduler(make_config()), AsyncScheduler(make_config())
    for scheduler, last_token in ((sync, 7), (overlapped, PLACEHOLDER_TOKEN_ID)):
        seq = make_seq([1, 2, 3])
        prefill(scheduler, seq)
        seq.append_token(last_token)
        out = scheduler.schedule()
        assert out.seqs == [seq] and not out.is_prefill
        assert len(seq.block_table) == 1 and seq.num_computed_tokens == 4
    assert len(sync.kv_cache_manager.pool.hash_to_block_id) == 1
    assert len(overlapped.kv_cache_manager.pool.hash_to_block_id) == 0
    seq = overlapped.running[0]
    seq.token_ids[-1] = 7  # the token arrives
    overlapped.kv_cache_manager.cache_blocks(seq, seq.num_computed_tokens)
    assert overlapped.kv_cache_manager.pool.hash_to_block_id == sync.kv_cache_manager.pool.hash_to_block_id


def test_a_placeholder_that_starts_a_block_gets_a_new_block():
    scheduler = AsyncScheduler(make_config())
    seq = make_seq([1, 2, 3, 4])
    prefill(scheduler, seq)  # block 0 full and registered at scheduling
    assert len(scheduler.kv_cache_manager.pool.hash_to_block_id) == 1
    seq.append_token(PLACEHOLDER_TOKEN_ID)
    scheduler.schedule()
    assert len(seq.block_table) == 2 and len(scheduler.kv_cache_manager.pool.hash_to_block_id) == 1


class FakeExecutor:
    """Samples token (10 * step + row) for each sampled row; records what each launch was fed."""

    def __init__(self):
        self.num_launches, self.fed = 0, []

    def launch(self, out, prev_token_ids=None):
        self.num_launches += 1
        self.fed.append(prev_token_ids)
        ids = [10 * self.num_launches + row for row in range(len(out.sampled_seqs))]
        return SimpleNamespace(token_ids=ids, ids=ids, select=lambda rows: None)

    def collect(self, handle):
        return ModelRunnerOutput(handle.ids)


def test_the_stepper_overlaps_decodes_and_collects_one_step_behind():
    scheduler = AsyncScheduler(make_config())
    executor, collected = FakeExecutor(), []

    def postprocess(result):
        out, token_ids = result.scheduler_output, result.output.sampled_token_ids
        assert all(PLACEHOLDER_TOKEN_ID not in seq.token_ids for seq in out.sampled_seqs)
        scheduler.update_from_output(out, token_ids)
        collected.append(list(token_ids))
        return token_ids

    stepper = AsyncStepper(scheduler, executor, postprocess)
    seqs = [make_seq([1, 2, 3], max_tokens=3), make_seq([4, 5], max_tokens=3)]
    for seq in seqs:
        scheduler.add(seq)
    assert stepper.step() == []  # the prefill is launched, nothing collected yet
    assert all(seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID for seq in seqs)
    assert stepper.step() == [10, 11]  # the prefill is drained (a decode cannot follow it unseen)
    assert stepper.inflight is None
    stepper.step()  # decode 1 launched
    assert stepper.step() == [20, 21]  # decode 2 launched before decode 1 is collected
    assert executor.fed[-1] == [20, 21]  # fed with decode 1's samples on the "device"
    assert stepper.step() == [30, 31]  # both reach max_tokens: the pipeline empties
    assert stepper.inflight is None and scheduler.is_finished()
    assert [seq.completion_token_ids for seq in seqs] == [[10, 20, 30], [11, 21, 31]]
