"""Prometheus metrics with vLLM's names, so that dashboards made for vLLM work unchanged.

Request latencies (TTFT, inter-token, end to end) and token counts are recorded after every engine
step (`record`, called from a background thread); queue lengths, KV-cache usage, prefix-cache and
preemption counts are the engine's as of its last step (AsyncLLM.scheduler_stats), read when
/metrics is scraped.
vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger).
"""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.engine.async_llm import AsyncLLM, IterationStats

# vLLM's buckets (seconds)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


class _EngineStateCollector:
    """Gauges and cumulative counters from the engine's last SchedulerStats, at scrape time."""

    def __init__(self, async_llm: AsyncLLM, model_name: str):
        self.async_llm, self.labels = async_llm, [model_name]

    def collect(self):
        stats = self.async_llm.scheduler_stats  # as of the engine's last step
        families = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             stats.kv_cache_usage),
            (GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under its older name "
             "(deprecated by vLLM in 2025, vllm-project/vllm#18354; older dashboards read it).", stats.kv_cache_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            (CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted (their KV freed, recomputed later).",
             stats.num_preemptions),
        ]
        for family_type, name, doc, value in families:
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric(self.labels, value)
            yield family
        yield from _spec_decode_families(stats.spec_decoding, self.labels)


def _spec_decode_families(spec, labels: list[str]):
    """vLLM's spec_decode counters (none without speculative decoding); accepted tokens per draft
    position are one counter labelled by `position`."""
    if spec is None:
        return
    for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Sequence-steps that verified a draft.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(labels, value)
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft.", labels=["model_name", "position"])
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric([*labels, str(position)], value)
    yield family


class PrometheusStatLogger:
    """Owns one registry (two servers in a process do not share metrics); `record` is the AsyncLLM hook."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's consecutive outputs.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

    def attach(self, async_llm: AsyncLLM):
        """Read the engine's queue and cache state at every scrape."""
        self.registry.register(_EngineStateCollector(async_llm, self.model_name))

    def record(self, stats: IterationStats):
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens:
            self.ttft.observe(seconds)
        for seconds in stats.inter_token_latencies:
            self.itl.observe(seconds)
        for finished in stats.finished_requests:
            self.e2e.observe(finished.e2e_latency)
            self.request_success[finished.finish_reason].inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
