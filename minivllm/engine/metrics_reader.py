"""The engine's metrics as objects, vLLM's offline reader shape (`llm.get_metrics()`): each has a
`.name` (vLLM's Prometheus name) and a `.value` (Counter, Gauge) or `.values` (Vector, one per
position). The same figures a server shows at /metrics.
vLLM: vllm/v1/metrics/reader.py.
"""
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def engine_metrics(stats, labels: dict[str, str]) -> list[Metric]:
    """stats: the engine core's SchedulerStats (engine_core.py)."""
    metrics = [
        Gauge("vllm:num_requests_running", labels, stats.num_running),
        Gauge("vllm:num_requests_waiting", labels, stats.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", labels, stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", labels, stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", labels, stats.prefix_cache_hits),
        Counter("vllm:num_preemptions", labels, stats.num_preemptions),
    ]
    return metrics + spec_decode_metrics(stats.spec_decoding, labels)


def spec_decode_metrics(spec, labels: dict[str, str]) -> list[Metric]:
    """vLLM's four spec_decode metrics ([] without speculative decoding)."""
    if spec is None:
        return []
    return [Counter("vllm:spec_decode_num_drafts", labels, spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", labels, spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, spec.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(spec.num_accepted_tokens_per_pos))]
