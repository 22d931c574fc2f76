"""A trace of the engine's steps, to find stalls: per step its kind, batch, host time and (on CUDA)
device time and the device's idle time before it, from CUDA events around each launch.

    host:    |sched+launch N|.. wait N, postprocess N ..|sched+launch N+1|....
    device:        |====== step N ======|  gap  |====== step N+1 ======|
                   ^start event         ^end    ^start event

A gap on the device is time the GPU waited for the host (scheduling, a Python pause, a stalled
engine loop); a long step with a short device time is host work inside the step. vLLM has no
single equivalent; its torch-profiler traces show the same thing in a timeline viewer.
"""
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    kind: str  # "prefill", "decode", "mixed" (decodes and prompt chunks in one step) or "mixed_unified"
    #            (a mixed step whose decode rows ran as 1-token chunks: engine/mixed_steps.py)
    num_seqs: int
    num_tokens: int  # tokens the model computed
    num_cached_tokens: int  # prompt tokens of newly admitted sequences found in the prefix cache
    start_s: float  # when the host began scheduling it, seconds since the trace started
    host_ms: float  # from scheduling to the end of its postprocessing (overlapped steps' spans overlap)
    wall_ms: float  # its share of wall time: from the later of its start and the previous step's end
    device_ms: float | None = None  # between the CUDA events around its launch (None off CUDA)
    device_gap_ms: float | None = None  # device idle between the previous step's end and its start
    # Speculative decoding (engine/spec_decode.py): decode rows that carried drafts, their draft
    # tokens, and how many of those the step accepted (0 without speculation)
    num_drafted_seqs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    propose_ms: float = 0.0  # host time of the proposer (a draft model's own forwards), inside host_ms


class StepTrace:
    """Records every step the engine collects, the last `max_steps` of them."""

    def __init__(self, use_cuda_events: bool, max_steps: int = 200_000, is_unified_mixed_step=None):
        """is_unified_mixed_step(out) -> bool: the runner's choice for a mixed step (None: never unified)."""
        self.use_cuda_events = use_cuda_events
        self.is_unified_mixed_step = is_unified_mixed_step
        self.records: deque[StepRecord] = deque(maxlen=max_steps)
        self.origin = time.perf_counter()
        # Launched steps not yet collected, in launch order: id(handle) -> (the handle, kept alive so
        # that its id stays unique; start event; end event)
        self._launches: OrderedDict[int, tuple] = OrderedDict()
        self._collected_events = None  # the events of the step collected last
        self._last_end_event = None
        self._last_end = None

    def launched(self, handle, start_event, end_event):
        self._launches[id(handle)] = (handle, start_event, end_event)

    def collected_events(self, handle):
        """A launched step's tokens have reached the host: its events go with the next record. (A
        handle narrowed to the rows still running, async scheduling's select, names the launched one.)"""
        self._collected_events = self._pop_launch(id(getattr(handle, "launched_as", None) or handle))

    def collected(self, result, end: float):
        """A step's record: `result` (core/engine.py's StepResult) was postprocessed by `end`."""
        out, start = result.scheduler_output, result.start_time
        wall_start = start if self._last_end is None else max(start, self._last_end)
        record = StepRecord(self._kind(out), out.num_seqs, out.num_batched_tokens, out.num_cached_tokens,
                            start - self.origin, (end - start) * 1e3, (end - wall_start) * 1e3)
        record.num_drafted_seqs, record.num_draft_tokens, record.num_accepted_tokens = draft_counts(result)
        record.propose_ms = getattr(out, "propose_ms", 0.0)
        events, self._collected_events = self._collected_events, None
        if events is not None:
            start_event, end_event = events
            end_event.synchronize()  # queued right after the step's token copy, which is done
            record.device_ms = start_event.elapsed_time(end_event)
            if self._last_end_event is not None:
                record.device_gap_ms = self._last_end_event.elapsed_time(start_event)
            self._last_end_event = end_event
        self._last_end = end
        self.records.append(record)

    def _kind(self, out) -> str:
        if not out.is_prefill:
            return "decode"
        if not out.num_decodes:
            return "prefill"
        unified = self.is_unified_mixed_step is not None and self.is_unified_mixed_step(out)
        return "mixed_unified" if unified else "mixed"

    def _pop_launch(self, key: int):
        """The events of the launch with this key; launches before it were never collected (async
        scheduling drops a step launched ahead for sequences that all finished): they ran on the
        device all the same, so the next gap counts from the end of the last of them."""
        if key not in self._launches:
            return None
        while True:
            launch_key, (_, start_event, end_event) = self._launches.popitem(last=False)
            if launch_key == key:
                return start_event, end_event
            self._last_end_event = end_event

    def drop_launches(self):
        """A failed step: its launches will never be collected."""
        self._launches.clear()
        self._collected_events = self._last_end_event = None

    def take(self) -> list[dict]:
        """The records so far, as dicts, and start afresh."""
        records = [asdict(r) for r in self.records]
        self.records.clear()
        return records


class TracedExecutor:
    """The engine's executor, with CUDA events around every step for its StepTrace (set `trace`);
    everything else is the executor's own."""

    def __init__(self, executor):
        self._executor = executor
        self.trace: StepTrace | None = None

    @staticmethod
    def _start_events():
        import torch

        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        return start_event, end_event

    def execute_model(self, out):
        if not self.trace.use_cuda_events:
            return self._executor.execute_model(out)
        start_event, end_event = self._start_events()
        output = self._executor.execute_model(out)
        end_event.record()
        self.trace.launched(output, start_event, end_event)
        self.trace.collected_events(output)
        return output

    def launch(self, out, prev_token_ids=None):
        if not self.trace.use_cuda_events:
            return self._executor.launch(out, prev_token_ids)
        start_event, end_event = self._start_events()
        handle = self._executor.launch(out, prev_token_ids)
        end_event.record()
        self.trace.launched(handle, start_event, end_event)
        return handle

    def collect(self, handle):
        output = self._executor.collect(handle)
        if self.trace.use_cuda_events:
            self.trace.collected_events(handle)
        return output

    def __getattr__(self, name):
        return getattr(self._executor, name)


def draft_counts(result) -> tuple[int, int, int]:
    """(drafted rows, draft tokens, accepted drafts) of a step: a drafted decode row i of a
    speculative step (`spec_token_ids[i]` not empty) got 1 + its accepted drafts as tokens."""
    drafts = getattr(result.scheduler_output, "spec_token_ids", None)
    if not drafts or not any(drafts):
        return 0, 0, 0
    num_decodes = result.scheduler_output.num_decodes
    rows = [(d, t) for d, t in zip(drafts[:num_decodes], result.output.sampled_token_ids[:num_decodes]) if d]
    return len(rows), sum(len(d) for d, _ in rows), sum(len(t) - 1 for _, t in rows)


def summarize(records: list[dict], num_slowest: int = 10) -> str:
    """A text summary of a step trace: time in steps by kind, time outside steps, device idle,
    and the slowest steps and longest device gaps with their neighbours."""
    if not records:
        return "step trace: no steps"
    lines = []
    wall_s = (records[-1]["start_s"] + records[-1]["host_ms"] / 1e3) - records[0]["start_s"]
    in_steps_s = sum(r["wall_ms"] for r in records) / 1e3
    lines.append(f"step trace: {len(records)} steps over {wall_s:.2f} s; in steps {in_steps_s:.2f} s, "
                 f"outside steps (engine idle or loop overhead) {wall_s - in_steps_s:.2f} s")
    for kind in ("prefill", "decode", "mixed", "mixed_unified"):
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        walls = sorted(r["wall_ms"] for r in rows)
        mean_seqs = sum(r["num_seqs"] for r in rows) / len(rows)
        mean_tokens = sum(r["num_tokens"] for r in rows) / len(rows)
        text = (f"  {kind:8s} {len(rows):6d} steps, {sum(walls) / 1e3:7.2f} s; wall ms p50 {_pct(walls, 0.5):6.2f} "
                f"p99 {_pct(walls, 0.99):7.2f} max {walls[-1]:7.2f}; mean batch {mean_seqs:.1f} seqs, "
                f"{mean_tokens:.0f} tokens")
        devices = sorted(r["device_ms"] for r in rows if r["device_ms"] is not None)
        if devices:
            text += f"; device ms p50 {_pct(devices, 0.5):.2f} p99 {_pct(devices, 0.99):.2f}"
        drafted = sum(r.get("num_drafted_seqs", 0) for r in rows)
        if drafted:
            accepted = sum(r["num_accepted_tokens"] for r in rows)
            text += (f"; {sum(1 for r in rows if r['num_drafted_seqs'])} steps with drafts, acceptance length "
                     f"{1 + accepted / drafted:.2f}")
        lines.append(text)
    gaps = [r["device_gap_ms"] for r in records if r["device_gap_ms"] is not None]
    if gaps:
        busy_s = sum(r["device_ms"] for r in records if r["device_ms"] is not None) / 1e3
        lines.append(f"  device busy {busy_s:.2f} s; idle between steps {sum(gaps) / 1e3:.2f} s, gap ms p50 "
                     f"{_pct(sorted(gaps), 0.5):.2f} p99 {_pct(sorted(gaps), 0.99):.2f} max {max(gaps):.2f}")
    lines.append("  slowest steps (wall ms; idle time between requests not counted):")
    order = sorted(range(len(records)), key=lambda i: records[i]["wall_ms"], reverse=True)[:num_slowest]
    for i in sorted(order):
        lines.append("    " + _describe(records, i))
    if gaps:
        lines.append("  longest device gaps (the step after the gap):")
        order = sorted((i for i, r in enumerate(records) if r["device_gap_ms"] is not None),
                       key=lambda i: records[i]["device_gap_ms"], reverse=True)[:num_slowest]
        for i in sorted(order):
            lines.append("    " + _describe(records, i))
    return "\n".join(lines)


def _describe(records: list[dict], i: int) -> str:
    r = records[i]
    text = (f"#{i} t={r['start_s']:.3f}s {r['kind']} {r['num_seqs']} seqs {r['num_tokens']} tokens: "
            f"wall {r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} ms")
    if r["device_ms"] is not None:
        text += f", device {r['device_ms']:.2f} ms"
    if r["device_gap_ms"] is not None:
        text += f", device idle before it {r['device_gap_ms']:.2f} ms"
    if r.get("num_drafted_seqs"):
        text += f", {r['num_accepted_tokens']}/{r['num_draft_tokens']} drafts accepted"
    if i > 0:
        prev = records[i - 1]
        text += f" (after a {prev['kind']} of {prev['num_seqs']} seqs)"
    return text


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
