"""docs/operations.md's "From Python" paragraph is the reference of `start_node` and `ProcessInfo`.

Tests and benchmarks start nodes with `start_node(...)`: every keyword it takes (its own, then
`build_node`'s and `Node`'s through `**node_options`) is in the documented signature, and the
documented signature names no keyword that none of them takes. `ProcessInfo(...)` lists exactly
the dataclass's fields, in order (a new field, such as `health_lost`, is documented with it).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay.node.supervisor import Node, ProcessInfo, build_node, start_node

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "operations.md").read_text()


def _named(func: Callable[..., Any]) -> set[str]:
    return {
        name
        for name, p in inspect.signature(func).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name not in ("self", "phases")
    }


def documented_start_node() -> set[str]:
    text = re.sub(r"\s+", " ", DOC)
    match = re.search(r"`start_node\((.*?)\) -> Node`", text)
    assert match, "docs/operations.md has no `start_node(...) -> Node` signature"
    # Drop parenthesised notes ("(command is None)", "(the config's ...)"), then take the names.
    args = match.group(1)
    while re.search(r"\([^()]*\)", args):
        args = re.sub(r"\([^()]*\)", "", args)
    return {a.split("=")[0].strip(" *") for a in args.split(",") if a.strip(" *")}


def test_start_node_documents_every_keyword_it_takes() -> None:
    accepted = _named(start_node) | _named(build_node) | _named(Node.__init__)
    documented = documented_start_node()
    assert sorted(accepted - documented) == [], "start_node keywords missing from docs/operations.md"
    assert sorted(documented - accepted) == [], (
        "docs/operations.md documents start_node keywords it does not take"
    )


def test_process_info_lists_its_fields_in_order() -> None:
    match = re.search(r"`ProcessInfo\(([^)]*)\)`", re.sub(r"\s+", " ", DOC))
    assert match, "docs/operations.md has no `ProcessInfo(...)`"
    documented = [f.strip() for f in match.group(1).split(",")]
    assert documented == [f.name for f in dataclasses.fields(ProcessInfo)]
