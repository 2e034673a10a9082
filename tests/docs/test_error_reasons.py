"""Every error reason the code can send to a caller is documented.

A reason (google.rpc.ErrorInfo.reason, a generation's `error.reason`, the SDK's
`KvRelayError.reason`) is part of the API: clients branch on it. The reasons are collected from
the source (a string literal given as the reason where an error is built) and each must be named
in backticks in README.md or docs/*.md, where its table says what it means, whether a retry can
help and what to do (docs/api.md, Errors; docs/broker.md, gRPC status codes and reasons).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where errors are built: the core and every service package (generated stubs left out).
SOURCES = ["kvrelay", "broker", "ar_service", "dit_service", "client"]
REASON = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")
# Built as (code, reason, message, ...): the reason is the second argument.
CODE_FIRST = {"KvRelayServerError", "ErrorInfo", "KvRelayError", "ErrorStatus"}
# The broker's errors (broker/tickets.py) and errors.failed_precondition: the reason comes first.
REASON_FIRST = {
    "BrokerError", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition", "IllegalTransition",
    "Unavailable", "ResourceExhausted", "Unauthenticated", "BrokenInvariant", "failed_precondition",
}  # fmt: skip


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def reasons_in(tree: ast.AST) -> set[str]:
    found: list[str | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name in CODE_FIRST and len(node.args) > 1:
                found.append(_literal(node.args[1]))
            if name in REASON_FIRST and node.args:
                found.append(_literal(node.args[0]))
            if name == "not_found" and node.args and (what := _literal(node.args[0])):
                found.append(f"{what.upper()}_NOT_FOUND")  # kvrelay.errors.not_found
            found.extend(_literal(kw.value) for kw in node.keywords if kw.arg == "reason")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                # reason = "X"  /  code, reason, message = "C", "X", "..."
                if isinstance(target, ast.Name) and target.id.endswith("reason"):
                    found.append(_literal(node.value))
                # error.reason = "X" (an ErrorInfo filled in field by field)
                if isinstance(target, ast.Attribute) and target.attr == "reason":
                    found.append(_literal(node.value))
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    found.extend(
                        _literal(v) for t, v in zip(target.elts, node.value.elts, strict=False)
                        if isinstance(t, ast.Name) and t.id == "reason"
                    )  # fmt: skip
    return {r for r in found if r and REASON.match(r)}


@cache
def code_reasons() -> dict[str, str]:
    """reason -> the first file that sends it.

    Parsed in a fresh interpreter: CPython 3.11's ast.parse can fail with "SystemError: AST
    constructor recursion depth mismatch" in a process whose earlier tests left its recursion
    accounting skewed (cpython gh-106905), which says nothing about the docs.
    """
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, check=True)
    return dict(json.loads(done.stdout))


def _collect() -> dict[str, str]:
    out: dict[str, str] = {}
    for root in SOURCES:
        for path in sorted((REPO / root).rglob("*.py")):
            if "v1" in path.relative_to(REPO).parts:
                continue
            for reason in reasons_in(ast.parse(path.read_text(), str(path))):
                out.setdefault(reason, str(path.relative_to(REPO)))
    return out


def documented_names() -> set[str]:
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    return set(re.findall(r"`([A-Z][A-Z0-9_]*)`", text))


def test_the_collector_sees_reasons_of_every_kind() -> None:
    # One reason per way of building an error, so a refactor that hides reasons from the collector
    # fails here rather than letting new reasons go unchecked.
    reasons = code_reasons()
    for reason in (
        "QUEUE_FULL",  # KvRelayServerError (broker admission)
        "UNKNOWN_TICKET",  # BrokerError subclass (broker core)
        "CLIENT_DISCONNECTED",  # a generation's ErrorInfo
        "GENERATION_NOT_FOUND",  # errors.not_found
        "TICKET_NOT_WRITABLE",  # the DiT's PutKv
        "STREAM_DROPPED",  # the SDK's own KvRelayError
        "PROMPT_TOO_LONG",  # an error's `.reason` set as an attribute (broker admission)
    ):
        assert reason in reasons, reason
    assert len(reasons) >= 60


def test_every_reason_the_code_sends_is_documented() -> None:
    documented = documented_names()
    missing = {r: where for r, where in code_reasons().items() if r not in documented}
    assert missing == {}, (
        "error reasons sent by the code but named nowhere in README.md or docs/*.md (add each to a "
        f"reasons table, docs/api.md 'Errors', with what it means, whether to retry, what to do): {missing}"
    )


def test_a_new_reason_is_collected_and_undocumented() -> None:
    tree = ast.parse('raise KvRelayServerError(grpc.StatusCode.INTERNAL, "SOMETHING_NEW", "m")')
    assert reasons_in(tree) == {"SOMETHING_NEW"}
    assert reasons_in(ast.parse('err = make()\nerr.reason = "SOMETHING_NEW"')) == {"SOMETHING_NEW"}
    assert "SOMETHING_NEW" not in documented_names()


def table_reasons(texts: dict[str, str]) -> dict[str, str]:
    """reason -> where: the names in backticks in the `reason` column of the docs' tables, what
    is in parentheses left out (prose: `NOT_SERVING` is a health status, `NOT_STARTED` a write's)."""
    out: dict[str, str] = {}
    for name, text in texts.items():
        lines = text.splitlines()
        column: int | None = None
        for i, line in enumerate(lines):
            if not line.startswith("|"):
                column = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if column is None:
                is_header = i + 1 < len(lines) and lines[i + 1].startswith("| ---")
                column = next((j for j, c in enumerate(cells) if c.lower() == "reason"), -1) if is_header else -1
                continue
            if 0 <= column < len(cells):
                cell = cells[column]
                while (bare := re.sub(r"\([^()]*\)", "", cell)) != cell:
                    cell = bare
                for reason in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell):
                    out.setdefault(reason, f"{name}:{i + 1}")
    return out


def _doc_texts() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}


def test_every_reason_a_docs_table_lists_is_one_the_code_sends() -> None:
    """A row for a reason nothing sends any more (renamed, removed) tells users to branch on a
    value that never comes. A status code name counts: an error without an ErrorInfo has its
    code as its reason (kvrelay.client.errors)."""
    import grpc

    known = set(code_reasons()) | {c.name for c in grpc.StatusCode}
    stale = {r: where for r, where in table_reasons(_doc_texts()).items() if r not in known}
    assert stale == {}, f"reasons documented in a table that no code sends (remove the row or fix the name): {stale}"


def test_every_reason_the_code_sends_has_a_table_row() -> None:
    """Named in prose is not enough: a user looks a reason up in a table with a `reason` column
    (docs/api.md, Errors; docs/broker.md). A status code name used as the reason is the code's."""
    import grpc

    codes = {c.name for c in grpc.StatusCode}
    tables = table_reasons(_doc_texts())
    missing = {r: where for r, where in code_reasons().items() if r not in tables and r not in codes}
    assert missing == {}, f"reasons sent by the code with no row in a reasons table (docs/api.md, Errors): {missing}"


def test_the_table_check_sees_a_reason_column() -> None:
    table = "| code | reason | when |\n| --- | --- | --- |\n| `X` | `GONE_NOW` (not `NOT_ME`) | w |\n"
    assert table_reasons({"t.md": table}) == {"GONE_NOW": "t.md:3"}
    assert len(table_reasons(_doc_texts())) >= 60


if __name__ == "__main__":
    print(json.dumps(_collect()))
