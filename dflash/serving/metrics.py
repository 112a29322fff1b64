"""``/metrics``: the server's counters in the Prometheus text format, through ``prometheus_client``.

Each server owns its own ``CollectorRegistry`` (never the process-wide default), so two servers in
one process, or a test that builds several, keep separate counts. The generation counters are one
collector read under one lock, so a scrape sees totals and the ratios derived from them (τ,
tokens/s) from the same moment; the live state (queue depth, busy, batch size) is read when
scraped. Time to first token and time per output token are histograms (one observation per
request; time per output token is the request's mean after its first token), kept in the same
collector so that they are read under the same lock and carry no ``_created`` series.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

# The format /metrics has always announced (prometheus_client's own default may be newer).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """Counters updated by the worker thread and the request handlers; ``render()`` for scrapes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens = 0
        self.reused_prompt_tokens = 0
        self.generation_tokens = 0
        self.cycles = 0
        self.generation_seconds = 0.0
        self.prefill_seconds = 0.0
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self.cancelled = 0
        self.cycle_tokens = 0.0
        self.last_tps = 0.0
        self.last_tau = 0.0
        self.accepted_at: list[float] = []
        self.proposed_at: list[float] = []
        self.target_passes = 0  # verify passes and plain steps, for the mean rows per pass
        self.target_rows = 0.0
        self.started = time.time()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.ttft = LatencyHistogram(
            "dflash_time_to_first_token_seconds",
            "Seconds from a request's arrival (queue included) to its first generated token.",
            TTFT_BUCKETS)
        self.tpot = LatencyHistogram(
            "dflash_time_per_output_token_seconds",
            "A request's mean seconds per generated token after the first.", TPOT_BUCKETS)

    def watch(self, info: dict[str, str], queue_depth: Callable[[], int],
              busy: Callable[[], bool], batch_size: Callable[[], int] | None = None,
              max_concurrency: int = 1) -> None:
        """Export what the server is (``dflash_info``) and its live state, read at each scrape."""
        Info("dflash", "The served model and drafter.", registry=self.registry).info(info)
        Gauge("dflash_queue_depth", "Requests waiting for the model.",
              registry=self.registry).set_function(queue_depth)
        Gauge("dflash_busy", "1 while a generation runs.",
              registry=self.registry).set_function(lambda: int(busy()))
        Gauge("dflash_batch_size", "Sequences decoding together now.",
              registry=self.registry).set_function(batch_size or (lambda: int(busy())))
        Gauge("dflash_max_concurrency", "Sequences the server admits to decode together.",
              registry=self.registry).set(max_concurrency)

    def watch_index(self, tokens: Callable[[], int], scopes: Callable[[], int],
                    nbytes: Callable[[], int] | None = None) -> None:
        """Export the continuation indexes' size (all scopes together), read at each scrape."""
        Gauge("dflash_index_tokens", "Tokens held by the continuation indexes of all scopes.",
              registry=self.registry).set_function(tokens)
        if nbytes is not None:
            Gauge("dflash_index_bytes", "Bytes of the continuation indexes of all scopes.",
                  registry=self.registry).set_function(nbytes)
        Gauge("dflash_index_scopes", "Scopes (API keys, or one shared) with an index.",
              registry=self.registry).set_function(scopes)

    def request(self, endpoint: str, status: str) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def cancelled_generation(self) -> None:
        with self.lock:
            self.cancelled += 1

    def generation(self, r, ttft: float | None = None, tpot: float | None = None) -> None:
        """Add a finished (or cancelled) generation, given its last ``DFlashResponse`` and its
        time to first token and mean time per output token (seconds) where it has them."""
        with self.lock:
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            passes = r.cycles + r.plain_steps
            self.target_passes += passes
            self.target_rows += r.rows_per_pass * passes
            self.reused_prompt_tokens += r.reused_prompt_tokens
            self.prompt_tokens += r.prompt_tokens
            self.generation_tokens += r.generation_tokens
            self.cycles += r.cycles
            self.cycle_tokens += r.mean_tau * r.cycles
            if r.generation_tps > 0:
                self.generation_seconds += r.generation_tokens / r.generation_tps
            if r.prompt_tps > 0:
                self.prefill_seconds += r.prompt_tokens / r.prompt_tps
            self.draft_seconds += r.draft_time
            self.verify_seconds += r.verify_time
            self.last_tps = r.generation_tps
            self.last_tau = r.mean_tau
            acc = r.acceptance_by_position
            if len(self.accepted_at) < len(acc):
                grow = len(acc) - len(self.accepted_at)
                self.accepted_at += [0.0] * grow
                self.proposed_at += [0.0] * grow
            for j, a in enumerate(acc):  # weighted by cycles: counts, approximately
                self.accepted_at[j] += a * r.cycles
                self.proposed_at[j] += r.cycles

    def collect(self) -> Iterator[Metric]:
        """The generation metrics (``prometheus_client``'s custom-collector interface)."""
        families: list[Metric] = []
        with self.lock:
            requests = CounterMetricFamily(
                "dflash_requests",
                "HTTP requests to the completion endpoints, by endpoint and outcome.",
                labels=["endpoint", "status"])
            for (endpoint, status), n in sorted(self.requests.items()) or [(("chat", "ok"), 0)]:
                requests.add_metric([endpoint, status], n)
            families.append(requests)
            counters = [
                ("dflash_cancelled", "Generations stopped because the client went away.",
                 self.cancelled),
                ("dflash_prompt_tokens", "Prompt tokens of the generations.", self.prompt_tokens),
                ("dflash_reused_prompt_tokens",
                 "Prompt tokens taken from the shared prefix cache instead of prefilled.",
                 self.reused_prompt_tokens),
                ("dflash_generation_tokens", "Tokens generated.", self.generation_tokens),
                ("dflash_cycles", "Verify cycles (drafted blocks and context continuations).",
                 self.cycles),
                ("dflash_generation_seconds", "Wall time spent decoding (after prefill).",
                 self.generation_seconds),
                ("dflash_prefill_seconds", "Wall time spent on prefill.", self.prefill_seconds),
                ("dflash_draft_seconds", "Time spent in drafter passes.", self.draft_seconds),
                ("dflash_verify_seconds", "Time spent in target verify passes.",
                 self.verify_seconds),
            ]
            for name, help_text, value in counters:
                families.append(CounterMetricFamily(name, help_text, value=value))
            tau = self.cycle_tokens / self.cycles if self.cycles else 0.0
            tps = (self.generation_tokens / self.generation_seconds
                   if self.generation_seconds else 0.0)
            gauges = [
                ("dflash_mean_tau",
                 "Tokens per cycle over all generations (acceptance length tau).", tau),
                ("dflash_tokens_per_second", "Decode tokens per second over all generations.",
                 tps),
                ("dflash_last_tokens_per_second",
                 "Decode tokens per second of the last generation.", self.last_tps),
                ("dflash_last_mean_tau", "Mean tau of the last generation.", self.last_tau),
                ("dflash_rows_per_pass",
                 "Target rows per pass (verify passes and plain steps), over all generations.",
                 self.target_rows / self.target_passes if self.target_passes else 0.0),
            ]
            for name, help_text, value in gauges:
                families.append(GaugeMetricFamily(name, help_text, value=value))
            by_position = GaugeMetricFamily(
                "dflash_acceptance_by_position",
                "Share of cycles whose draft token at this block position was accepted.",
                labels=["position"])
            for j, (a, p) in enumerate(zip(self.accepted_at, self.proposed_at)):
                by_position.add_metric([str(j + 1)], a / p if p else 0.0)
            families.append(by_position)
            families += [self.ttft.family(), self.tpot.family()]
            families.append(GaugeMetricFamily("dflash_uptime_seconds",
                                              "Seconds since the server started.",
                                              value=time.time() - self.started))
        return iter(families)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything this server exports."""
        return generate_latest(self.registry)


class LatencyHistogram:
    """Bucket counts of one latency (seconds); read and written under ``Metrics.lock``."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.bounds = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def family(self) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return HistogramMetricFamily(self.name, self.help, buckets=cumulative,
                                     sum_value=self.sum)
