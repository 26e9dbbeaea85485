"""Prometheus metrics under vLLM's names and meanings (`vllm:...{model_name=...}`), so that dashboards and load
tools written for vLLM read leanlm unchanged. Latencies are recorded per request by the HTTP handlers; the
engine's state (queues, KV usage, prefix cache, preemptions) is read when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from leanlm.engine.engine import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)


class _EngineState:
    """A collector that reads the engine's EngineStats when scraped."""

    def __init__(self, stats: Callable[[], EngineStats], model: str):
        self.stats, self.labels = stats, {"model_name": model}

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        e = self.stats()
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", "Sequences in model execution batches.",
                           e.running)
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", "Sequences waiting to be processed.",
                           e.waiting)
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.",
                           e.kv_usage)
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.",
                           e.prefix_queries)
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.",
                           e.prefix_hits)
        yield self._family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative preemptions by the scheduler.",
                           e.preemptions)
        # speculation (a draft model or prompt lookup), as vLLM counts it: acceptance rate = accepted / draft
        # tokens, mean acceptance length = 1 + accepted / drafts
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Verifications of a proposal.",
                           e.spec_drafts)
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Tokens proposed.",
                           e.spec_proposed)
        yield self._family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                           e.spec_accepted)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Proposed tokens accepted, by position in the proposal.",
                                      labels=[*self.labels, "position"])
        for i, n in enumerate(e.spec_accepted_per_pos):
            per_pos.add_metric([*self.labels.values(), str(i)], n)
        yield per_pos


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model: str):
        """stats: the engine's current EngineStats (an engine front end's `stats`)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(stats, model))
        labels, reg = ["model_name"], self.registry

        def histogram(name, doc):
            return Histogram(name, doc, labels, registry=reg, buckets=LATENCY_BUCKETS).labels(model)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens in seconds.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=reg).labels(model)
        self.success = Counter("vllm:request_success", "Successfully processed requests.",
                               labels + ["finished_reason"], registry=reg)
        self.model = model

    def finished(self, reason: str) -> None:
        self.success.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
