"""Prometheus metrics with vLLM's names under a `hearth:` prefix, in a registry of their own.

Request-level numbers (prompt tokens, finished requests by reason, TTFT, TPOT, end-to-end
latency, queue time) are observed by the server as requests are accepted and end. Engine
state (running / waiting requests, KV cache usage and blocks, prefix cache, preemptions,
generated tokens) is the AsyncEngine's latest EngineStats snapshot, read when /metrics is
scraped; the process's own numbers (resident memory, CPU, file descriptors) are prometheus_client's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hearth.engine.async_engine import AsyncEngine
from hearth.outputs import RequestOutput

# vLLM's buckets, so that the same dashboards read well
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector:
    """Engine state, read at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        labels = [self.model_name]
        stats = self.engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
        yield gauge("hearth:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("hearth:num_requests_waiting", "Requests waiting to be scheduled.", self.engine.num_waiting)
        yield gauge("hearth:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats.kv_cache_usage)
        yield gauge("hearth:kv_cache_blocks_used", "KV cache blocks held by requests.", stats.num_kv_blocks_used)
        yield gauge("hearth:kv_cache_blocks", "KV cache blocks in all.", stats.num_kv_blocks)
        yield gauge("hearth:prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens, since start.",
                    hits / queries if queries else 0.0)
        yield counter("hearth:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("hearth:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        for tier, counts in (("disk", stats.kv_disk_tier), ("ram", stats.kv_ram_tier)):  # --kv-cache-dir, -ram
            name, what = f"hearth:kv_{tier}_tier", f"the {tier.upper() if tier == 'ram' else tier} tier"
            yield counter(f"{name}_hits", f"KV blocks loaded back from {what}.", counts.hits)
            yield counter(f"{name}_read_bytes", f"Bytes read from {what}.", counts.bytes_read)
            yield counter(f"{name}_written_bytes", f"Bytes written to {what}.", counts.bytes_written)
            yield counter(f"{name}_read_seconds", f"Seconds spent reading {what}.", counts.read_seconds)
            yield counter(f"{name}_write_seconds", f"Seconds spent writing {what}.", counts.write_seconds)
        yield counter("hearth:kv_disk_tier_skipped_files", "Disk tier files skipped: truncated, corrupted or "
                      "foreign.", stats.kv_disk_tier.skipped)
        yield counter("hearth:kv_disk_tier_dropped_blocks", "Blocks not written to the disk tier: its writer's queue "
                      "was full.", stats.kv_disk_tier.dropped)
        yield counter("hearth:num_preemptions", "Requests preempted (blocks taken back, recomputed later).",
                      stats.num_preemptions)
        yield counter("hearth:generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        spec = stats.spec_decode  # speculative decoding, vLLM's names
        yield counter("hearth:spec_decode_num_drafts", "Verifications of a request's guesses.", spec.num_drafts)
        yield counter("hearth:spec_decode_num_draft_tokens", "Guessed tokens verified.", spec.num_draft_tokens)
        yield counter("hearth:spec_decode_num_accepted_tokens", "Guessed tokens accepted.", spec.num_accepted_tokens)
        per_position = CounterMetricFamily("hearth:spec_decode_num_accepted_tokens_per_pos",
                                           "Guessed tokens accepted, by position among the guesses (0: the first).",
                                           labels=["model_name", "position"])
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        cascade = stats.cascade  # a cascade's (--cascade SMALL,LARGE): finished requests
        if cascade is not None:
            yield counter("hearth:cascade_requests", "Finished requests of the cascade.", cascade.num_requests)
            yield counter("hearth:cascade_deferred_requests", "Finished requests that moved to the large model.",
                          cascade.num_deferred)
            yield counter("hearth:cascade_small_model_tokens", "Output tokens the small model drew.",
                          cascade.num_small_tokens)
            yield counter("hearth:cascade_large_model_tokens", "Output tokens the large model drew.",
                          cascade.num_large_tokens)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("hearth:prompt_tokens", "Prompt tokens of accepted requests.", labels, registry=r)
        self.request_success = Counter(
            "hearth:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.ttft = Histogram("hearth:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("hearth:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("hearth:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("hearth:request_queue_time_seconds", "Arrival to first scheduling.", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine, model_name))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (on Linux)
        for reason in ("stop", "length", "abort"):  # show the series before the first request ends
            self.request_success.labels(model_name, reason)

    def on_accepted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def on_aborted(self) -> None:
        self.request_success.labels(self.model_name, "abort").inc()

    def on_finished(self, output: RequestOutput) -> None:
        name = self.model_name
        reason = output.outputs[0].finish_reason if output.outputs else "stop"
        self.request_success.labels(name, reason or "stop").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
            num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if m.first_token_time is not None and num_tokens > 1:
                self.tpot.labels(name).observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
