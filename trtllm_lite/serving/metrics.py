"""Prometheus metrics of a serving process (prometheus-client), names prefixed ``trtllm_lite_``.

Per request (recorded by ``EngineService`` as deltas pass): histograms of TTFT, TPOT,
ITL, E2E latency and queue time (seconds), prompt and generation token counters, and
outcomes (finish reason, or the error class; ``deadline_exceeded`` also when gRPC cancels a
call at its deadline, ``cancelled`` when the client cancels before). Engine state (running and
waiting requests, KV cache usage, preemptions) is read from ``AsyncLLM.stats()`` at each
scrape, so nothing polls. Buckets follow vLLM's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..async_llm import AsyncLLM
    from ..outputs import RequestOutput
    from .engine_service import Accumulator

PREFIX = "trtllm_lite_"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0)


#: Stats exported when the engine reports them: (stats key, type, metric name, help).
_OPTIONAL = (
    ("blocks_cached", GaugeMetricFamily, "kv_cache_blocks_cached", "KV blocks findable in the prefix cache."),
    ("kv_waste_fraction", GaugeMetricFamily, "kv_cache_waste_ratio",
     "Allocated KV slots not holding a token, over allocated slots (running sequences)."),
    ("prefix_query_tokens", CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_hit_tokens", CounterMetricFamily, "prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    ("spec_num_drafts", CounterMetricFamily, "spec_decode_num_drafts", "Speculative verifications run."),
    ("spec_num_draft_tokens", CounterMetricFamily, "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("spec_num_accepted_tokens", CounterMetricFamily, "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("spec_acceptance_rate", GaugeMetricFamily, "spec_decode_acceptance_rate", "Accepted / proposed draft tokens."),
    ("spec_mean_accepted_length", GaugeMetricFamily, "spec_decode_mean_accepted_length",
     "Tokens emitted per verification (1 + accepted drafts)."),
)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def __init__(self):
        self.llm: AsyncLLM | None = None

    def collect(self):
        if self.llm is None:
            return
        s = self.llm.stats()
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests being scheduled (running).",
                                value=s["num_running"])
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                value=s["num_waiting"])
        yield GaugeMetricFamily(PREFIX + "num_requests_in_flight", "Requests accepted and not finished.",
                                value=s["num_in_flight"])
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).",
                                value=s["blocks_used"] / s["num_blocks"] if s["num_blocks"] else 0.0)
        yield GaugeMetricFamily(PREFIX + "kv_cache_blocks_used", "KV blocks in use.", value=s["blocks_used"])
        yield GaugeMetricFamily(PREFIX + "kv_cache_blocks_total", "KV blocks in the pool.", value=s["num_blocks"])
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Preemptions (recompute) so far.",
                                  value=s["num_preemptions"])
        yield CounterMetricFamily(PREFIX + "engine_steps", "Engine steps run.", value=s["num_steps"])
        if "prefix_hit_rate" in s:
            yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens.",
                                    value=s["prefix_hit_rate"])
        for key, kind, name, doc in _OPTIONAL:
            if key in s:
                yield kind(PREFIX + name, doc, value=s[key])


class Metrics:
    """The serving metrics, on their own registry (``registry``); :meth:`render` gives the
    text exposition format."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(PREFIX + "time_to_first_token_seconds",
                                             "TTFT: arrival to first token.", buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                               "TPOT: (E2E - TTFT) / (output tokens - 1), per request.",
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(PREFIX + "inter_token_latency_seconds",
                                             "ITL: time between successive deltas of a request.",
                                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(PREFIX + "e2e_request_latency_seconds",
                                             "E2E: arrival to finish.", buckets=_REQUEST_BUCKETS, registry=r)
        self.request_queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                            "Arrival to first scheduled.", buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests the engine ran, "
                                     "however they ended (record_tokens).", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of the requests the "
                                         "engine ran, however they ended (record_tokens).", registry=r)
        self.request_outcomes = Counter(PREFIX + "request_outcomes",
                                        "Finished sequences by finish reason (stop, length, abort) and failed "
                                        "requests by error (invalid_argument, already_exists, resource_exhausted, "
                                        "deadline_exceeded, unavailable, internal, cancelled).",
                                        ["outcome"], registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def bind(self, llm: "AsyncLLM") -> None:
        """Read engine gauges from ``llm`` at scrape time."""
        self._engine.llm = llm

    def record_first_token(self, out: "RequestOutput") -> None:
        """Observe a request's TTFT (seconds) from its first output with tokens (``out``), when
        that token comes, however the request ends later (vLLM observes it at the first token too)."""
        if out.metrics is not None and out.metrics.ttft is not None:
            self.time_to_first_token.observe(out.metrics.ttft)

    def record_finished(self, acc: "Accumulator") -> None:
        """Observe a finished request's E2E, queue time and TPOT, and count its outcome."""
        m = acc.last.metrics
        timing = acc.timing_ms()
        if m.e2e is not None:
            self.e2e_request_latency.observe(m.e2e)
        if "queue_ms" in timing:
            self.request_queue_time.observe(timing["queue_ms"] / 1e3)
        if "tpot_ms" in timing:
            self.time_per_output_token.observe(timing["tpot_ms"] / 1e3)
        for s in acc.results():
            self.request_outcomes.labels(s.finish_reason or "abort").inc()

    def record_failed(self, outcome: str) -> None:
        self.request_outcomes.labels(outcome).inc()

    def record_tokens(self, acc: "Accumulator") -> None:
        """Count the prompt and generated tokens of a request that ended (``acc``: its output,
        none if it never had any), however it ended: finished, cancelled, failed, or ended with
        another prompt of its call. The engine computed them, and vLLM's counters count them
        alike; the request outcomes are counted apart (:meth:`record_finished`, :meth:`record_failed`)."""
        if acc.last is not None:
            self.prompt_tokens.inc(acc.num_prompt_tokens)
            self.generation_tokens.inc(acc.num_completion_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
