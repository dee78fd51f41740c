"""Prometheus metrics with vLLM's names and meanings, under the `hasten:` prefix.

Per-request histograms and counters are recorded by the server when a request ends;
engine-level state (running/waiting requests, KV-cache usage, prefix-cache and
preemption counters, which the engine keeps cumulatively) is read from
`engine.get_stats()` at scrape time by a custom collector, so it is never stale and
costs the engine loop nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hasten.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineStatsCollector(Collector):
    """Emits the engine's own gauges and cumulative counters when /metrics is scraped."""

    def __init__(self, get_engine: Callable[[], Any], model_name: Callable[[], str]) -> None:
        self._get_engine = get_engine
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        engine = self._get_engine()
        stats = engine.get_stats() if engine is not None else None
        labels = [self._model_name()]

        def value(name: str) -> float:
            return float(getattr(stats, name, 0) or 0) if stats is not None else 0.0

        for name, attr, doc in (
            ("num_requests_running", "num_running", "Number of requests in model execution batches."),
            ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
        ):
            gauge = GaugeMetricFamily(f"hasten:{name}", doc, labels=["model_name"])
            gauge.add_metric(labels, value(attr))
            yield gauge
        for name, attr, doc in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
            ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
            ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
        ):
            counter = CounterMetricFamily(f"hasten:{name}", doc, labels=["model_name"])
            counter.add_metric(labels, value(attr))
            yield counter
        proposer = getattr(stats, "spec_proposer", None) if stats is not None else None
        if proposer:  # speculative decoding, per proposer (vLLM's spec_decode_* names)
            for name, attr, doc in (
                ("spec_decode_num_draft_tokens", "spec_proposed_tokens", "Draft tokens proposed."),
                ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted."),
                ("spec_decode_num_emitted_tokens", "spec_emitted_tokens", "Tokens emitted by verification steps."),
            ):
                counter = CounterMetricFamily(f"hasten:{name}", doc, labels=["model_name", "proposer"])
                counter.add_metric([*labels, proposer], value(attr))
                yield counter
            proposed = value("spec_proposed_tokens")
            gauge = GaugeMetricFamily("hasten:spec_decode_acceptance_rate", "Accepted / proposed draft tokens.",
                                      labels=["model_name", "proposer"])
            gauge.add_metric([*labels, proposer], value("spec_accepted_tokens") / proposed if proposed else 0.0)
            yield gauge


class ServerMetrics:
    """All of the server's metrics, in a registry of their own (so tests can build many apps)."""

    def __init__(self, get_engine: Callable[[], Any], model_name: Callable[[], str]) -> None:
        disable_created_metrics()  # no `_created` series, as in vLLM
        self.registry = CollectorRegistry()
        self._model_name = model_name
        r = self.registry
        label = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"hasten:{name}", doc, label, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                        _ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: decode time / (generated tokens - 1).", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time spent waiting before first scheduled.",
                          _LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to first token.",
                            _LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from first token to last token.",
                           _LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time from first scheduled to finished.",
                              _LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.",
                               _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens of finished requests.",
                            _TOKEN_BUCKETS)
        self.params_n = hist("request_params_n", "The n parameter of requests.", (1, 2, 5, 10, 20))
        self.prompt_tokens = Counter("hasten:prompt_tokens", "Prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("hasten:generation_tokens", "Generation tokens produced.", label,
                                         registry=r)
        self.request_success = Counter("hasten:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.engine_restarts = Counter("hasten:engine_restarts", "Automatic restarts of a failed engine.",
                                       registry=r)
        self.engine_request_failures = Counter(
            "hasten:engine_request_failures", "Requests the engine failed alone (the step went on for the rest).",
            label, registry=r)
        r.register(EngineStatsCollector(get_engine, model_name))

    def model_name(self) -> str:
        return self._model_name()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe_request(self, output: RequestOutput | None, n: int, client_gone: bool = False) -> None:
        """Record one engine request that has ended (finished, failed or aborted)."""
        model = self._model_name()
        if output is None:
            self.request_success.labels(model, "abort").inc()
            return
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(model).inc(num_generated)
        for comp in output.outputs:
            reason = comp.finish_reason or "abort"
            if client_gone and not output.finished:
                reason = "abort"
            self.request_success.labels(model, reason).inc()
        self.params_n.labels(model).observe(n)
        m = output.metrics
        if m is None or not output.finished:
            return
        self.prompt_len.labels(model).observe(len(output.prompt_token_ids))
        self.gen_len.labels(model).observe(num_generated)
        end = m.finished_time or time.time()
        self.e2e.labels(model).observe(max(0.0, end - m.arrival_time))
        for hist, value in ((self.ttft, m.ttft), (self.queue, m.queue_time),
                            (self.prefill, m.prefill_time), (self.decode, m.decode_time)):
            if value is not None:
                hist.labels(model).observe(max(0.0, value))
        if m.first_scheduled_time is not None:
            self.inference.labels(model).observe(max(0.0, end - m.first_scheduled_time))
        times = m.token_times
        if len(times) >= 2:
            itl = self.itl.labels(model)
            for a, b in zip(times, times[1:], strict=False):
                itl.observe(max(0.0, b - a))
        decode = m.decode_time
        if decode is not None and num_generated > 1:
            per_seq = max(len(c.token_ids) for c in output.outputs)
            if per_seq > 1:
                self.tpot.labels(model).observe(max(0.0, decode / (per_seq - 1)))
