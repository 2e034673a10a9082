"""Bounds on what a holder of the replica token can make the broker hold (docs/operations.md,
Security). The design trusts that token; these limits keep a leaked one, or a buggy replica, from
exhausting the broker. Each test fails without its bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import MAX_PAGES_PER_REPLICA, MAX_REPLICAS, MAX_TOTAL_PAGES
from kvrelay.broker.tickets import ResourceExhausted
from kvrelay.config import BrokerConfig
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, new_incarnation


def _core(path: Path | None, clock: ManualClock, **kw: int) -> BrokerCore:
    return BrokerCore(path, clock=clock, drain_quiet_seconds=0.01, journal_synchronous="NORMAL", **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ total pages across replicas


def test_the_config_defaults_are_the_registry_bounds() -> None:
    cfg = BrokerConfig()  # type: ignore[call-arg]
    assert (cfg.max_replicas, cfg.max_total_pages) == (MAX_REPLICAS, MAX_TOTAL_PAGES)
    # The default bound holds far less than the 2 GiB of 256 fake DiTs at the largest page count.
    assert MAX_TOTAL_PAGES < MAX_REPLICAS * MAX_PAGES_PER_REPLICA * 2 // 16


def test_fake_dit_replicas_at_the_largest_page_count_are_refused_beyond_the_page_budget() -> None:
    # Found by audit: 256 made-up DiT replicas registered at MAX_PAGES_PER_REPLICA pages and two CFG
    # groups, each under the per-replica bound, grew the broker by about 2 GiB of page states.
    clock = ManualClock()
    core = _core(None, clock, max_total_pages=3 * MAX_PAGES_PER_REPLICA)
    core.register_replica(dit_spec("dit-0", num_pages=MAX_PAGES_PER_REPLICA))
    core.register_replica(dit_spec("dit-1", num_pages=MAX_PAGES_PER_REPLICA))
    with pytest.raises(ResourceExhausted) as err:
        core.register_replica(dit_spec("dit-2", num_pages=MAX_PAGES_PER_REPLICA, cfg_parallel_size=2))
    assert (err.value.code, err.value.reason) == ("RESOURCE_EXHAUSTED", "PAGE_BUDGET_EXHAUSTED")
    assert "replica.num_pages" in err.value.message and "broker.max_total_pages" in err.value.message
    assert "dit-2" not in core.registry and core.registry.total_pages() == 2 * MAX_PAGES_PER_REPLICA
    core.register_replica(dit_spec("dit-2", num_pages=MAX_PAGES_PER_REPLICA))  # exactly the budget fits
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-3", num_pages=1))
    # AR replicas hold no pages: the page budget never refuses one.
    core.register_replica(ar_spec("ar-0"))


def test_the_page_budget_forgets_idle_replicas_but_never_one_that_holds_pages(tmp_path: Path) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock, max_total_pages=200)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    ticket = core.create_ticket("req-1", ar.replica_id, dit.replica_id, [20])
    assert ticket is not None
    core.register_replica(dit_spec("dit-fake", num_pages=100))
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-new", num_pages=100))  # every one is up: none forgotten
    clock.advance(core.lease_seconds + 1)
    # Lapsed: the idle fake is forgotten to make room; dit-0 stays, its pages held by a live ticket.
    core.register_replica(dit_spec("dit-new", num_pages=100))
    assert sorted(r.spec.replica_id for r in core.registry) == ["ar-0", "dit-0", "dit-new"]
    assert core.get_ticket(ticket.ticket_id).dit_replica_id == "dit-0"
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-more", num_pages=64))  # dit-0 is never evicted
    # A new incarnation of a held replica with as many pages re-registers; one growing them is refused.
    clock.advance(core.lease_seconds + 1)
    core.register_replica(dit_spec("dit-new", num_pages=100, incarnation="second"))
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-new", num_pages=137, incarnation="third"))
    assert core.registry.get("dit-new").spec.incarnation_id == "second"


def test_a_journaled_replica_registers_again_under_a_lowered_budget(tmp_path: Path) -> None:
    # The budget never refuses a registration that does not grow what the broker holds: after a
    # restart with a smaller broker.max_total_pages, the replicas whose tickets it journaled (pages
    # that may be in doubt) still reconcile, and a new incarnation with as many pages still comes.
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    assert core.create_ticket("req-1", ar.replica_id, dit.replica_id, [20]) is not None
    core.journal.close()
    restored = _core(tmp_path / "j.sqlite", clock, max_total_pages=10)
    restored.register_replica(dit)  # same incarnation: reconciles
    restored.register_replica(ar)
    restored.register_replica(new_incarnation(dit))
    assert restored.registry.get("dit-0").up(clock())
