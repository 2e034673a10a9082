"""The journal's ticket record: `TicketRecord` <-> the JSON object stored in the tickets table.

Owns the field-by-field format of a live ticket in the journal, so that a broker restarted on an
older file reads back every reservation, write and load it had committed. Must never decide
anything about what it decodes: replaying the records into pools (and ending the requests that
died with the broker) is BrokerCore's job. Replica records carry their own format
(`ReplicaRecord.to_json`, registry.py), generations theirs (`record_to_json`, generations.py).
"""

from __future__ import annotations

from typing import Any

from kvrelay.broker.tickets import (
    LoadKey,
    RowPages,
    TicketOutcome,
    TicketRecord,
    TicketState,
    WriteKey,
    WriteRecord,
    WriteStatus,
)


def ticket_to_json(t: TicketRecord) -> dict[str, Any]:
    return {
        "ticket_id": t.ticket_id, "request_id": t.request_id,
        "ar_replica_id": t.ar_replica_id, "dit_replica_id": t.dit_replica_id,
        "rows": [[r.row, r.num_tokens, list(r.page_ids)] for r in t.rows],
        "sequence": t.sequence, "src_shards": t.src_shards, "dst_shards": t.dst_shards,
        "create_time": t.create_time, "update_time": t.update_time,
        "state": t.state.value, "outcome": t.outcome.value if t.outcome else None, "reason": t.reason,
        "armed": t.armed, "armed_incarnation": t.armed_incarnation, "dit_incarnation": t.dit_incarnation,
        "request_over": t.request_over,
        "writes": [
            [k.row, k.src_rank, k.dst_rank, w.status.value, w.checksum, w.bytes, w.message]
            for k, w in t.writes.items()
        ],
        "loads": [[k.row, k.dst_rank, v] for k, v in t.loads.items()],
        "last_resolution_time": t.last_resolution_time, "drain_start_time": t.drain_start_time,
        "version": t.version, "orphaned": t.orphaned, "by_hand": t.by_hand,
    }  # fmt: skip


def ticket_from_json(d: dict[str, Any]) -> TicketRecord:
    t = TicketRecord(
        ticket_id=d["ticket_id"],
        request_id=d["request_id"],
        ar_replica_id=d["ar_replica_id"],
        dit_replica_id=d["dit_replica_id"],
        rows=tuple(RowPages(r[0], r[1], tuple(r[2])) for r in d["rows"]),
        write_keys=(),
        src_shards=d["src_shards"],
        dst_shards=d["dst_shards"],
        sequence=d["sequence"],
        dit_incarnation=d["dit_incarnation"],
        now=d["create_time"],
    )
    t.update_time = d["update_time"]
    t.state = TicketState(d["state"])
    t.outcome = TicketOutcome(d["outcome"]) if d["outcome"] else None
    t.reason = d["reason"]
    t.armed = d["armed"]
    t.armed_incarnation = d["armed_incarnation"]
    t.request_over = d["request_over"]
    t.writes = {
        WriteKey(w[0], w[1], w[2]): WriteRecord(WriteStatus(w[3]), w[4], w[5], w[6]) for w in d["writes"]
    }
    t.loads = {LoadKey(row, dst): bool(v) for row, dst, v in d["loads"]}
    t.last_resolution_time = d["last_resolution_time"]
    t.drain_start_time = d["drain_start_time"]
    t.version = d["version"]
    t.orphaned = bool(d.get("orphaned", False))  # absent in records journaled before it existed
    t.by_hand = bool(d.get("by_hand", False))  # likewise: such a ticket was taken for a generation's
    return t
