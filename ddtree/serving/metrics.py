"""Server counters: Prometheus metrics on a per-app registry plus the running totals /server_info reports."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

THROUGHPUT_WINDOW_S = 1.0  # last_gen_throughput is measured over at least this much decode time


class ServerMetrics:
    """Thread-safe: the scheduler thread records rounds, the event loop records rejections."""

    def __init__(self) -> None:
        # a registry per app, so several apps in one process (tests) never share counters
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens prefilled", registry=self.registry)
        self.generation_tokens = Counter(
            "ddtree_generation_tokens", "Output tokens committed", registry=self.registry
        )
        self.verify_steps = Counter(
            "ddtree_spec_verify_steps", "Target verify forwards, summed over requests", registry=self.registry
        )
        self.accepted_drafts = Counter(
            "ddtree_spec_accepted_drafts",
            "Drafted tokens accepted (accepted length minus the bonus token), summed over rounds",
            registry=self.registry,
        )
        self.requests = Counter(
            "ddtree_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.rounds = Counter("ddtree_decode_rounds", "Decode rounds of the whole batch", registry=self.registry)
        self.round_seconds = Counter(
            "ddtree_decode_round_seconds",
            "Time in decode rounds (launch to outputs, what the batch's step() takes, host sync included)",
            registry=self.registry,
        )
        self.running = Gauge("ddtree_running_requests", "Requests in the batch", registry=self.registry)
        self.queued = Gauge("ddtree_queued_requests", "Requests waiting for a slot", registry=self.registry)
        self._lock = threading.Lock()
        self._tokens_total = 0
        self._verify_total = 0
        self._window_tokens = 0
        self._window_time = 0.0
        self._last_throughput = 0.0

    def record_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def record_progress(self, new_tokens: int, new_verify_steps: int, accepted_drafts: int) -> None:
        self.generation_tokens.inc(new_tokens)
        self.verify_steps.inc(new_verify_steps)
        self.accepted_drafts.inc(accepted_drafts)
        with self._lock:
            self._tokens_total += new_tokens
            self._verify_total += new_verify_steps

    def record_round(self, tokens: int, seconds: float, rounds: int = 1) -> None:
        """`rounds` step()s of the whole batch (1, or a relayed sum): the round counters and last_gen_throughput
        (tokens/s over >= 1 s of rounds)."""
        self.rounds.inc(rounds)
        self.round_seconds.inc(seconds)
        with self._lock:
            self._window_tokens += tokens
            self._window_time += seconds
            if self._window_time >= THROUGHPUT_WINDOW_S:
                self._last_throughput = self._window_tokens / self._window_time
                self._window_tokens, self._window_time = 0, 0.0

    def record_outcome(self, outcome: str, count: int = 1) -> None:
        self.requests.labels(outcome=outcome).inc(count)

    def set_load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)

    @property
    def avg_spec_accept_length(self) -> float:
        """Cumulative tokens / verify steps since start (a cross-check; the suite weights per request)."""
        with self._lock:
            return self._tokens_total / self._verify_total if self._verify_total else 0.0

    @property
    def last_gen_throughput(self) -> float:
        with self._lock:
            if self._window_time > 0 and self._last_throughput == 0.0:
                return self._window_tokens / self._window_time  # before the first full window
            return self._last_throughput

    def render(self) -> bytes:
        return generate_latest(self.registry)
