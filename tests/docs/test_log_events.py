"""Log events the docs name are events the code logs.

An operator greps logs and writes alerts for the event names the docs give (`logs one warning
`child_not_serving``, `log `generation_retried``): a name the code does not log (renamed, never
written, a typo) makes that grep or alert silently match nothing. Every event name the docs give
where they say it is logged (after "log", "logs", "logged", "event(s)", "warning(s)", optionally
"one warning", "an error", ...) must be the event of a log call in the product's code. The table
of docs/operations.md's "Warnings and what to do" must name, in its first column, only events the
code logs and metrics a process serves, and at least one of each per row. The reverse: every event
the code logs at warning level or above (`log.warning`, `.error`, `.exception`, `.critical`, or a
name bound to one, as `notice = log.warning if ... else log.info`) is one a doc says is logged or
a Warnings table names, so an operator who sees it finds what it means and what to do.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.docs.test_metrics_reference import served

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("kvrelay", "broker", "ar_service", "dit_service", "client")
DOCS = (*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "benchmarks" / "README.md")
LEVELS = frozenset({"debug", "info", "warning", "error", "exception", "critical"})
EVENT = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
TICKED = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`")
# "logs one warning `a` (fields...), then `b`", "log `a`", "events (`a`, `b`, ...)".
LEAD = (
    r"\b(?:log|logs|logged|logging|events?|warnings?)(?:\s+(?:one|a|an|its|the))?"
    r"(?:\s+(?:info|warning|error|debug))?(?:\s+(?:line|event|record))?\s+\(?"
)
NAMES = r"((?:`[a-z][a-z0-9_]*`(?:\s*\([^)]*\))?(?:,\s*|\s+(?:and|or|then)\s+|\s*/\s*)?)+)"
LOGGED = re.compile(LEAD + NAMES, re.IGNORECASE)
RUNBOOK = "\n## Warnings and what to do"


ALERTING = frozenset({"warning", "error", "exception", "critical"})
LEVEL_WORD = re.compile(r"\.(" + "|".join(sorted(LEVELS)) + r")\b")


def _is_log_call(func: ast.expr, aliases: dict[str, set[str]]) -> bool:
    """`log.warning(...)`, `(log.info if x else log.debug)(...)`, or a name bound to such."""
    if isinstance(func, ast.Attribute) and func.attr in LEVELS:
        return True
    if isinstance(func, ast.Name):
        return func.id in aliases
    return re.search(r"\blog\.", ast.unparse(func)) is not None


def _levels(func: ast.expr, aliases: dict[str, set[str]]) -> set[str]:
    """The levels a log call may log at (`notice = log.warning if x else log.info`: both)."""
    if isinstance(func, ast.Attribute) and func.attr in LEVELS:
        return {func.attr}
    if isinstance(func, ast.Name):
        return aliases[func.id]
    return set(LEVEL_WORD.findall(ast.unparse(func)))


@cache
def emitted_levels() -> dict[str, frozenset[str]]:
    """Each event (first argument) of a log call in the product's code, with every level it is
    logged at."""
    levels: dict[str, set[str]] = {}
    for package in PRODUCT:
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            aliases = {
                target.id: set(LEVEL_WORD.findall(ast.unparse(node.value)))
                for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and re.search(r"\blog\.", ast.unparse(node.value))
                for target in node.targets
                if isinstance(target, ast.Name)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and node.args and _is_log_call(node.func, aliases):
                    first = node.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str) and EVENT.fullmatch(first.value):
                        levels.setdefault(first.value, set()).update(_levels(node.func, aliases))
    return {event: frozenset(found) for event, found in levels.items()}


def emitted_events() -> frozenset[str]:
    """The event (first argument) of every log call in the product's code."""
    return frozenset(emitted_levels())


def logged_names(text: str) -> set[str]:
    """Event names `text` says are logged (the fields in parentheses after one are not)."""
    names: set[str] = set()
    for match in LOGGED.finditer(re.sub(r"\s+", " ", text)):
        names.update(TICKED.findall(re.sub(r"\([^)]*\)", "", match.group(1))))
    return names


def test_the_pattern_finds_what_the_docs_say_is_logged() -> None:
    text = (
        "`kvrelay up` logs one warning `child_not_serving`\nnaming the child, and one "
        "`child_serving_again`; the broker logs `generation_retried` (`request_id`, `attempt`) "
        "and counts `kvrelay_generation_retries_total`; the supervisor's own events (`child_started`, "
        "`child_exited`) stay; its `request_id` is no event."
    )
    assert logged_names(text) == {"child_not_serving", "generation_retried", "child_started", "child_exited"}


def test_every_event_the_docs_say_is_logged_is_logged_by_the_code() -> None:
    emitted = emitted_events()
    assert {"generation_retried", "child_not_serving", "credential_reloaded"} <= emitted  # the scan works
    unknown = {
        f"{doc.relative_to(REPO)}: {name}"
        for doc in DOCS
        for name in logged_names(doc.read_text())
        if name not in emitted
    }
    assert sorted(unknown) == [], f"log events the docs name that no code logs: {sorted(unknown)}"


def runbook_rows() -> list[list[str]]:
    """The first cell's backticked names of each row of operations.md's Warnings table."""
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index(RUNBOOK)
    section = text[start : text.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    signal = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:\{[a-z_,]*\})?`")  # a metric with its labels
    return [signal.findall(re.sub(r"\([^)]*\)", "", line.split(" | ")[0])) for line in rows]


def test_every_signal_of_the_warnings_table_is_logged_or_served() -> None:
    emitted, metrics = emitted_events(), set(served())
    rows = runbook_rows()
    assert len(rows) >= 5, rows
    for names in rows:
        assert names, "a row of the Warnings table names no event or metric in its first cell"
        unknown = [n for n in names if n not in emitted and n not in metrics]
        assert unknown == [], f"Warnings table signals that no code logs or serves: {unknown}"


def documented_events() -> set[str]:
    """Events the docs say are logged, and those the Warnings tables name in a first cell."""
    return {n for doc in DOCS for n in logged_names(doc.read_text())} | {n for row in runbook_rows() for n in row}


def test_the_level_scan_sees_aliases_and_conditional_levels() -> None:
    levels = emitted_levels()
    assert levels["write_in_doubt"] == {"warning"}
    assert levels["generation_pipeline_crashed"] == {"exception"}
    assert levels["replica_new_incarnation"] == {"warning", "info"}  # notice = log.warning if ... else log.info
    assert levels["journal_compacted"] == {"info", "debug"}  # (log.info if ... else log.debug)(...)
    assert {"warning", "info"} <= levels["wait_interrupted"]  # logged at both, in three places


def test_every_event_logged_at_warning_or_above_is_documented() -> None:
    """The reverse of the test above: an operator who sees a warning or an error finds in docs/
    what it means and what to do (operations.md's "Warnings and what to do" has a row for each
    that no other page explains)."""
    documented = documented_events()
    undocumented = sorted(e for e, levels in emitted_levels().items() if levels & ALERTING and e not in documented)
    assert undocumented == [], (
        f"events logged at warning level or above that no doc names: {undocumented}; add each to "
        "docs/operations.md's 'Warnings and what to do' (what it means, what to do)"
    )
