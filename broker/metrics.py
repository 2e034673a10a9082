"""Prometheus metrics of the broker's pages, tickets and replicas (DESIGN.md section 11).

Owns `kvrelay_pages{replica,state}`, `kvrelay_tickets{state}`,
`kvrelay_draining_oldest_seconds`, `kvrelay_replica_up{replica,role}` and
`kvrelay_replica_fenced{replica}`. They are read from BrokerCore at scrape time by a custom
collector, so the lifecycle's hot path never updates a gauge and a scrape can never disagree
with GetPool. Must never mutate the core. Also the generations' metrics (`GenerationMetrics`:
`kvrelay_generations_total{outcome}`, `kvrelay_generation_seconds`, `kvrelay_phase_seconds{phase}`,
`kvrelay_generations_queued`, `kvrelay_generation_retries_total{reason}`), which the orchestrator updates as each generation ends, and the
journal's (`JournalCollector`: `kvrelay_journal_size_bytes`, `kvrelay_journal_compacted_rows_total`,
`kvrelay_journal_reclaimed_bytes_total`), read at scrape time from the compactor, and the
credential reloads' (`kvrelay_broker_credential_reloads_total{outcome}`,
`kvrelay_broker_credential_grace_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.broker.compaction import JournalCompactor
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.credential_reload import BrokerSecrets
from kvrelay.broker.generations import PHASES, RETRY_REASONS, GenerationSnapshot, GenState
from kvrelay.broker.tickets import TicketState

_OUTCOME_OF_STATE = {
    GenState.SUCCEEDED: "succeeded",
    GenState.FAILED: "failed",
    GenState.CANCELLED: "cancelled",
}


class BrokerCollector(Collector):
    def __init__(
        self, core: BrokerCore, rpc_counts: Mapping[str, int] | None = None, secrets: BrokerSecrets | None = None
    ) -> None:
        self.core = core
        self.rpc_counts = rpc_counts
        self.secrets = secrets

    def collect(self) -> Iterator[Metric]:
        core = self.core
        pages = GaugeMetricFamily("kvrelay_pages", "DiT pages by state", labels=["replica", "state"])
        for pool in core.pool_status():
            pages.add_metric([pool.replica_id, "free"], pool.free)
            pages.add_metric([pool.replica_id, "reserved"], pool.reserved)
            pages.add_metric([pool.replica_id, "draining"], pool.draining)
        yield pages
        # Free pages a request could get: 0 for a replica the journal kept that is not live (an
        # earlier config's, or one whose lease lapsed) or that is fenced. kvrelay_pages stays
        # the exact accounting (free + reserved + draining = total) of every replica kept.
        available = GaugeMetricFamily(
            "kvrelay_pages_available",
            "DiT pages a request could get now (free pages of a live, unfenced replica; else 0)",
            labels=["replica"],
        )
        for pool in core.pool_status():
            available.add_metric([pool.replica_id], pool.available)
        yield available

        tickets = GaugeMetricFamily(
            "kvrelay_tickets", "Tickets by state (RELEASED: released since the broker started)", labels=["state"]
        )
        counts = core.ticket_state_counts()
        counts[TicketState.RELEASED] = core.released_total
        for state in TicketState:
            tickets.add_metric([state.value], counts[state])
        yield tickets

        yield GaugeMetricFamily(
            "kvrelay_draining_oldest_seconds",
            "Age of the oldest DRAINING ticket (0 when none): a writer that never resolves shows here",
            value=core.draining_oldest_seconds(),
        )

        up = GaugeMetricFamily("kvrelay_replica_up", "1 while the replica holds a lease", labels=["replica", "role"])
        fenced = GaugeMetricFamily("kvrelay_replica_fenced", "1 when the replica is fenced", labels=["replica"])
        for status in core.list_replicas():
            up.add_metric([status.spec.replica_id, status.spec.role.value.lower()], 1.0 if status.up else 0.0)
            fenced.add_metric([status.spec.replica_id], 1.0 if status.fenced else 0.0)
        yield up
        yield fenced
        # Tickets with a FAILED or WRITER_GONE write, by how their pages came back: a heartbeat of
        # their DiT proved its receivers drained, or they waited receiver_settle_seconds.
        settled = CounterMetricFamily(
            "kvrelay_receiver_settle",
            "Tickets with a FAILED or WRITER_GONE write released, by how (proven_drained: a DiT heartbeat "
            "proved every receiver ran; settle_time: the whole receiver_settle_seconds)",
            labels=["how"],
        )
        settled.add_metric(["proven_drained"], core.receiver_settled_early_total)
        settled.add_metric(["settle_time"], core.receiver_settled_full_total)
        yield settled

        if self.rpc_counts is not None:
            rpcs = CounterMetricFamily(
                "kvrelay_broker_rpcs", "BrokerService calls by method (round trips replicas make)", labels=["method"]
            )
            for method, count in sorted(dict(self.rpc_counts).items()):
                rpcs.add_metric([method], count)
            yield rpcs

        if self.secrets is not None:
            reloads = CounterMetricFamily(
                "kvrelay_broker_credential_reloads",
                "kvrelay rotate-secrets calls by outcome (reloaded: new credentials taken; unchanged; failed: nothing taken)",
                labels=["outcome"],
            )
            for outcome, count in sorted(dict(self.secrets.outcomes).items()):
                reloads.add_metric([outcome], count)
            yield reloads
            yield GaugeMetricFamily(
                "kvrelay_broker_credential_grace_seconds",
                "Seconds the credentials the last reload replaced are still taken (0: only the current ones)",
                value=self.secrets.rotation.grace_left_s(),
            )


def register_broker_metrics(
    core: BrokerCore, registry: CollectorRegistry | None = None, rpc_counts: Mapping[str, int] | None = None,
    secrets: BrokerSecrets | None = None,
) -> CollectorRegistry:
    """Register the broker's collector on `registry` (a new one when None) and return it."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(BrokerCollector(core, rpc_counts, secrets))
    return registry


class JournalCollector(Collector):
    """The journal's size and what compaction removed. Reads only counters and stat() results,
    so a scrape (the metrics thread) never touches the SQLite connection the event loop writes."""

    def __init__(self, compactor: JournalCompactor) -> None:
        self.compactor = compactor

    def collect(self) -> Iterator[Metric]:
        c = self.compactor
        yield GaugeMetricFamily(
            "kvrelay_journal_size_bytes", "The broker journal on disk: its file and WAL", value=c.journal.size_bytes()
        )
        yield CounterMetricFamily(
            "kvrelay_journal_compacted_rows",
            "Journal rows deleted because their generation passed retention (result_ttl_seconds, max_results)",
            value=c.rows_deleted,
        )
        yield CounterMetricFamily(
            "kvrelay_journal_reclaimed_bytes",
            "Free journal pages given back to the filesystem by compaction",
            value=c.bytes_reclaimed,
        )


class GenerationMetrics:
    """kvrelay_generations_total{outcome}, kvrelay_generation_seconds, kvrelay_phase_seconds{phase}."""

    def __init__(self, registry: CollectorRegistry, queue_depth: Callable[[], int]) -> None:
        self.queued = Gauge(
            "kvrelay_generations_queued",
            "Generations admitted and waiting (FIFO) for pages and a ticket",
            registry=registry,
        )
        self.queued.set_function(queue_depth)
        self.generations = Counter(
            "kvrelay_generations", "Finished generations by outcome", ["outcome"], registry=registry
        )
        self.generation_seconds = Histogram(
            "kvrelay_generation_seconds",
            "End-to-end time of succeeded generations (accepted to image)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.phase_seconds = Histogram(
            "kvrelay_phase_seconds",
            "Time of each phase of succeeded generations, measured where it happened",
            ["phase"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 300),
            registry=registry,
        )
        self.retries = Counter(
            "kvrelay_generation_retries",
            "Generations run again after the replica serving them failed or their KV transfer failed "
            "(broker.max_replica_retries), by the reason that ended the attempt",
            ["reason"],
            registry=registry,
        )
        for outcome in _OUTCOME_OF_STATE.values():
            self.generations.labels(outcome)
        for reason in RETRY_REASONS:
            self.retries.labels(reason)
        for phase in PHASES:
            self.phase_seconds.labels(phase)

    def retried(self, reason: str) -> None:
        self.retries.labels(reason).inc()

    def finished(self, snap: GenerationSnapshot) -> None:
        self.generations.labels(_OUTCOME_OF_STATE[snap.state]).inc()
        if snap.state is GenState.SUCCEEDED:
            self.generation_seconds.observe(snap.timings.get("total", 0.0))
            for phase in PHASES:
                if phase in snap.timings:
                    self.phase_seconds.labels(phase).observe(snap.timings[phase])
