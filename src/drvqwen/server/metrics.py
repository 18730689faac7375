"""Prometheus metrics of the server (GET /metrics, the text exposition format).

    drvqwen_requests_total{route, status}      requests answered, by HTTP status
    drvqwen_requests_cancelled_total           generations ended by the client going away
    drvqwen_prompt_tokens_total                prompt tokens of the requests run
    drvqwen_prompt_tokens_reused_total         of those, taken from the KV cache (not prefilled)
    drvqwen_generated_tokens_total             tokens generated (decode)
    drvqwen_queue_wait_seconds                 histogram: enqueued → the worker takes it
    drvqwen_ttft_seconds                       histogram: enqueued → first token (includes the wait)
    drvqwen_itl_seconds                        histogram: between consecutive tokens
    drvqwen_queue_length                       gauge: requests waiting
    drvqwen_kv_pages_free                      gauge: free KV-cache pages

A registry of its own per server (not prometheus_client's global one), so that two servers in
one process (the tests) count apart.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. ITL from a fraction of a millisecond (GPU decode) to a second (the CPU reference on a
# large model); TTFT and queue wait up to minutes (a long prompt on the CPU, a long queue).
ITL_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The server's counters, histograms and gauges (thread-safe: the worker updates them).

    Args:
        queue_length: returns the number of requests waiting.
        kv_pages_free: returns the free KV-cache pages.
    """

    def __init__(self, queue_length: Callable[[], int], kv_pages_free: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("drvqwen_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.cancelled = Counter("drvqwen_requests_cancelled", "generations ended because the client went away",
                                 registry=r)
        self.prompt_tokens = Counter("drvqwen_prompt_tokens", "prompt tokens of the requests run", registry=r)
        self.prompt_tokens_reused = Counter("drvqwen_prompt_tokens_reused",
                                            "prompt tokens taken from the KV cache, not prefilled", registry=r)
        self.generated_tokens = Counter("drvqwen_generated_tokens", "tokens generated", registry=r)
        self.queue_wait = Histogram("drvqwen_queue_wait_seconds", "enqueued to taken by the worker",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram("drvqwen_ttft_seconds", "enqueued to first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("drvqwen_itl_seconds", "time between consecutive tokens", buckets=ITL_BUCKETS,
                             registry=r)
        Gauge("drvqwen_queue_length", "requests waiting", registry=r).set_function(queue_length)
        Gauge("drvqwen_kv_pages_free", "free KV-cache pages", registry=r).set_function(kv_pages_free)

    def text(self) -> bytes:
        """The exposition text (content type `CONTENT_TYPE`)."""
        return generate_latest(self.registry)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
