"""`aotgen serve`'s Prometheus metrics (`GET /metrics`), named as vLLM names its own with the
`aotgen:` prefix, so that dashboards built for one read the other: requests running and
waiting, requests finished by reason, prompt / cached / generated tokens, speculative tokens
drafted and accepted, the lookup cache's n-grams, and histograms of time to first token, time
per output token and end-to-end latency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from aotgen.runtime.batch_engine import BatchEngine
    from aotgen.runtime.engine import GenerationResult

# vLLM's buckets (seconds).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on


class ServeMetrics:
    """One server's metrics in a registry of their own; `observe` each finished request."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: BatchEngine):
        self.registry = CollectorRegistry()
        registry = self.registry
        scheduler = engine.scheduler
        Gauge(
            "aotgen:num_requests_running", "Requests holding a slot.", registry=registry
        ).set_function(lambda: len(scheduler.running))
        Gauge(
            "aotgen:num_requests_waiting", "Requests waiting for a slot.", registry=registry
        ).set_function(lambda: len(scheduler.waiting))
        Gauge(
            "aotgen:lookup_cache_ngrams",
            "n-grams in the lookup cache of earlier requests (0 without one).",
            registry=registry,
        ).set_function(lambda: len(engine.engine.lookup_cache or ()))
        self.finished = Counter(
            "aotgen:request_success",
            "Requests finished, by reason.",
            ["finished_reason"],
            registry=registry,
        )
        self.prompt = Counter("aotgen:prompt_tokens", "Prompt tokens.", registry=registry)
        self.cached = Counter(
            "aotgen:prompt_tokens_cached", "Prompt tokens found in the KV cache.", registry=registry
        )
        self.generated = Counter("aotgen:generation_tokens", "Generated tokens.", registry=registry)
        self.drafted = Counter(
            "aotgen:spec_decode_num_draft_tokens",
            "Tokens proposed by speculation.",
            registry=registry,
        )
        self.accepted = Counter(
            "aotgen:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", registry=registry
        )
        self.ttft = Histogram(
            "aotgen:time_to_first_token_seconds",
            "Time to the first token, queueing included.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "aotgen:time_per_output_token_seconds",
            "Time per token after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "aotgen:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )

    def observe(self, result: GenerationResult) -> None:
        """A finished request (any thread: the engine's calls it)."""
        self.finished.labels(finished_reason=result.finish_reason).inc()
        self.prompt.inc(result.prompt_tokens)
        self.cached.inc(result.cached_tokens)
        self.generated.inc(len(result.token_ids))
        if result.spec is not None:
            self.drafted.inc(result.spec.drafted)
            self.accepted.inc(result.spec.accepted)
        if result.token_ids:
            self.ttft.observe(result.prefill_s)
            if len(result.token_ids) > 1:
                self.tpot.observe(result.decode_s / (len(result.token_ids) - 1))
        self.e2e.observe(result.prefill_s + result.decode_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
