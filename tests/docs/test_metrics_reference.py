"""docs/operations.md's Metrics table is the reference of every kvrelay metric.

Every `kvrelay_*` metric a process serves (its registry as the process's own code builds it) has a
row (first column, in backticks; a counter with its `_total`), with the type and the process the
code gives it; every name a row documents is one a process serves (a renamed metric leaves
dashboards and alerts querying nothing, silently). The node's own `kvrelay_node_scrape_*` are
documented in the prose above the table.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.foundation.test_metrics import families, node_only_names, process_registries

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "operations.md"
# The table's process column, per registry of tests.foundation.test_metrics.process_registries.
PROCESS_COLUMN = {"broker": "broker", "ar": "AR", "dit": "DiT"}


def documented_rows() -> dict[str, tuple[str, str]]:
    """metric name -> (type column, process column) of the Metrics table."""
    text = DOC.read_text()
    start = text.index("\n## Metrics")
    section = text[start : text.index("\n## ", start + 1)]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 5:
            continue
        names = re.findall(r"`([a-z0-9_*]+)`", cells[0])
        types = [t.strip() for t in cells[1].split(",")] if cells[1] else []
        for i, name in enumerate(names):
            # "histogram, counter" types the names of one row in order; one type covers them all.
            kind = types[i] if len(types) == len(names) else (types[0] if types else "")
            rows[name] = (kind, cells[3])
    return rows


def served() -> dict[str, tuple[str, str]]:
    """metric name as queried (a counter with `_total`) -> (type, process) for every kvrelay_*."""
    out: dict[str, tuple[str, str]] = {}
    for process, registry in process_registries().items():
        for name, (kind, _help) in families(registry).items():
            if not name.startswith("kvrelay_"):
                continue
            queried = name + "_total" if kind == "counter" else name
            if name.startswith("kvrelay_grpc_server_"):
                out[queried] = (kind, "every")
            else:
                out[queried] = (kind, PROCESS_COLUMN[process])
    return out


def test_every_served_metric_has_a_row_with_its_type_and_process() -> None:
    rows = documented_rows()
    missing = sorted(set(served()) - set(rows))
    assert missing == [], f"metrics served but not in docs/operations.md's Metrics table: {missing}"
    wrong = {n: (rows[n], s) for n, s in served().items() if rows[n] != s}
    assert wrong == {}, f"rows whose (type, process) differ from the code's: {wrong}"


def test_every_row_names_a_served_metric() -> None:
    documented = {n for n in documented_rows() if n.startswith("kvrelay_")}
    stale = sorted(documented - set(served()) - node_only_names())
    assert stale == [], f"docs/operations.md's Metrics table documents metrics nobody serves: {stale}"


def test_every_metric_the_docs_name_anywhere_is_served() -> None:
    """Not only the table: every `kvrelay_*` name in the docs' prose (an alert to set, a gauge to
    watch) is a metric a process serves, queried as such (a counter with or without `_total`, a
    histogram's `_bucket`/`_sum`/`_count`, a family by its prefix and `*`). A log event the code
    emits under such a name (the AR's `kvrelay_read_failed`) is no metric name."""
    from tests.docs.test_log_events import emitted_events  # that module imports this one

    names = set(served()) | set(node_only_names()) | {e for e in emitted_events() if e.startswith("kvrelay_")}
    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "benchmarks" / "README.md"]
    unknown: set[str] = set()
    for doc in docs:
        for match in re.finditer(r"\bkvrelay_[a-z0-9_]+\b\*?", doc.read_text()):
            name = match.group(0)
            if name.endswith("*"):
                known = any(n.startswith(name.rstrip("*")) for n in names)
            else:
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                known = bool({name, base, name + "_total"} & names)
            if not known:
                unknown.add(f"{doc.relative_to(REPO)}: {name}")
    assert sorted(unknown) == [], f"metric names in the docs that no process serves: {sorted(unknown)}"
