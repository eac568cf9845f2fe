"""`GET /metrics`: engine and request metrics in Prometheus' text format (prometheus-client).

Names follow vLLM's `vllm:*` metrics under a `jaxpaged:` prefix. Gauges and counters are read
from the engine's stats when scraped; latency histograms are observed as requests finish.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxpaged.engine.async_llm_engine import AsyncLLMEngine
from jaxpaged.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                          0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector:
    """Gauges and counters from `AsyncLLMEngine.stats()` at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(f"jaxpaged:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self):
        s = self.engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "num_requests_running", "Requests with a sequence running.",
                           s["num_running_requests"])
        yield self._family(gauge, "num_requests_waiting", "Requests waiting to be scheduled.",
                           s["num_waiting_requests"])
        yield self._family(gauge, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                           s["num_used_blocks"] / s["num_total_blocks"])
        yield self._family(gauge, "num_kv_blocks_free", "Free KV blocks.", s["num_free_blocks"])
        yield self._family(gauge, "num_kv_blocks_total", "KV blocks in the pool.",
                           s["num_total_blocks"])
        yield self._family(gauge, "weight_bytes", "Bytes of the model's parameters.",
                           s["weight_bytes"])
        yield self._family(gauge, "kv_cache_bytes_per_token",
                           "KV pool bytes per token, all layers (8-bit pools: codes and scales).",
                           s["kv_cache_bytes_per_token"])
        yield self._family(counter, "prompt_tokens", "Prompt tokens computed by prefills.",
                           s["num_prompt_tokens"])
        yield self._family(counter, "generation_tokens", "Tokens generated.",
                           s["num_generation_tokens"])
        yield self._family(counter, "num_preemptions", "Sequences preempted by recompute.",
                           s["num_preemptions"])
        yield self._family(counter, "num_requests_failed",
                           "Requests failed by a fault in an engine step (500s).",
                           s["num_failed_requests"])
        if "num_spec_drafts" in s:  # speculative decoding (vLLM's spec_decode_* counters)
            yield self._family(counter, "spec_decode_num_drafts",
                               "Sequence steps that verified speculative proposals.",
                               s["num_spec_drafts"])
            yield self._family(counter, "spec_decode_num_draft_tokens",
                               "Speculative tokens proposed.", s["num_spec_draft_tokens"])
            yield self._family(counter, "spec_decode_num_accepted_tokens",
                               "Speculative tokens accepted.", s["num_spec_accepted_tokens"])


class ServerMetrics:
    """A registry of its own per app, so several apps can live in one process (tests)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name

        def histogram(name, doc, buckets):
            return Histogram(f"jaxpaged:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time to first token (TTFT), seconds.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first (TPOT), seconds, "
                              "per request.", _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to finish, seconds.", _LATENCY_BUCKETS)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None or m.first_token_time is None or m.finished_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe(m.finished_time - m.arrival_time)
        num_tokens = m.num_generation_tokens  # the output may be a stream's last delta
        if num_tokens > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
