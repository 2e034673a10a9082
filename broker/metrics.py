"""Prometheus metrics of the broker's pages, tickets and replicas (DESIGN.md section 11).

Owns `kvrelay_pages{replica,state}`, `kvrelay_tickets{state}`,
`kvrelay_draining_oldest_seconds`, `kvrelay_replica_up{replica,role}` and
`kvrelay_replica_fenced{replica}`. They are read from BrokerCore at scrape time by a custom
collector, so the lifecycle's hot path never updates a gauge and a scrape can never disagree
with GetPool. Must never mutate the core.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.tickets import TicketState


class BrokerCollector(Collector):
    def __init__(self, core: BrokerCore, rpc_counts: Mapping[str, int] | None = None) -> None:
        self.core = core
        self.rpc_counts = rpc_counts

    def collect(self) -> Iterator[Metric]:
        core = self.core
        pages = GaugeMetricFamily("kvrelay_pages", "DiT pages by state", labels=["replica", "state"])
        for pool in core.pool_status():
            pages.add_metric([pool.replica_id, "free"], pool.free)
            pages.add_metric([pool.replica_id, "reserved"], pool.reserved)
            pages.add_metric([pool.replica_id, "draining"], pool.draining)
        yield pages

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

        if self.rpc_counts is not None:
            rpcs = CounterMetricFamily(
                "kvrelay_broker_rpcs", "BrokerService calls by method (round trips replicas make)", labels=["method"]
            )
            for method, count in sorted(dict(self.rpc_counts).items()):
                rpcs.add_metric([method], count)
            yield rpcs


def register_broker_metrics(
    core: BrokerCore, registry: CollectorRegistry | None = None, rpc_counts: Mapping[str, int] | None = None
) -> CollectorRegistry:
    """Register the broker's collector on `registry` (a new one when None) and return it."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(BrokerCollector(core, rpc_counts))
    return registry
