"""Prometheus metrics with SGLang's names (`sglang:*`), served at /metrics.

Updated from the scheduler thread (prometheus-client is thread-safe); one registry per server.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sglang_dflash.scheduler.schedule_batch import Req

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
GAP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
ACCEPT_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16)
ACCEPT_WINDOW = 64  # finished requests averaged by the spec_accept_length gauge


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests = counter("sglang:num_requests", "Finished requests")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Requests finished by an abort")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens")
        self.num_retractions = counter("sglang:num_retracted_requests", "Requests retracted when KV ran out")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.tpot = histogram("sglang:time_per_output_token_seconds", "Time per output token", TPOT_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.host_gap = histogram(
            "sglang:scheduler_host_gap_seconds", "Host time between two consecutive scheduler steps", GAP_BUCKETS
        )
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests in the running batch")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting or prefilling")
        self.token_usage = gauge("sglang:token_usage", "Fraction of KV cache slots in use (not free nor evictable)")
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate", "Prefix cache hit rate: cached / all prompt tokens of admitted requests"
        )
        self.kv_evictable_tokens = gauge(
            "sglang:kv_evictable_tokens", "KV slots holding radix-cached prefixes no running request uses"
        )
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served by the prefix cache")
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length", f"Mean tokens committed per verify step (last {ACCEPT_WINDOW} requests)"
        )
        self.spec_accept_length_per_req = histogram(
            "sglang:spec_accept_length_per_request", "Mean tokens committed per verify step, per request",
            ACCEPT_BUCKETS,
        )
        self.recent_spec: deque[tuple[int, int]] = deque(maxlen=ACCEPT_WINDOW)  # (tokens, verify steps)
        self.spec_steps_by_source = Counter(
            "sglang:spec_verify_steps_by_source", "Verify steps per proposal source (dflash, lookup, none)",
            ["model_name", "source"], registry=reg,
        )
        self.spec_steps_by_block = Counter(
            "sglang:spec_verify_steps_by_block_size", "Verify steps per chosen block size (bonus included)",
            ["model_name", "block_size"], registry=reg,
        )
        self.model_name = model_name

    def on_admitted(self, req: Req) -> None:
        self.prompt_tokens.inc(len(req.origin_input_ids))

    def on_finished(self, req: Req) -> None:
        self.num_requests.inc()
        self.cached_tokens.inc(req.cached_tokens)
        reason = req.finished_reason or {}
        if reason.get("type") == "abort":
            self.num_aborted_requests.inc()
        if req.finished_time is not None:
            self.e2e.observe(req.finished_time - req.created_time)
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.created_time)
            if req.finished_time is not None and len(req.output_ids) > 1:
                self.tpot.observe((req.finished_time - req.first_token_time) / (len(req.output_ids) - 1))
        if req.spec_verify_ct:
            committed = req.spec_accepted_drafts + req.spec_verify_ct
            self.spec_accept_length_per_req.observe(committed / req.spec_verify_ct)
            self.recent_spec.append((committed, req.spec_verify_ct))
            self.spec_accept_length.set(sum(c for c, _ in self.recent_spec) / sum(v for _, v in self.recent_spec))
            for source, n in req.spec_sources.items():
                self.spec_steps_by_source.labels(self.model_name, source).inc(n)
            for size, n in enumerate(req.spec_block_histogram, 1):
                if n:
                    self.spec_steps_by_block.labels(self.model_name, str(size)).inc(n)

    def on_step(self, num_running: int, num_queued: int, used_kv: int, total_kv: int) -> None:
        self.num_running_reqs.set(num_running)
        self.num_queue_reqs.set(num_queued)
        self.token_usage.set(used_kv / max(total_kv, 1))

    def on_cache(self, evictable_tokens: int, hit_rate: float) -> None:
        self.kv_evictable_tokens.set(evictable_tokens)
        self.cache_hit_rate.set(hit_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
