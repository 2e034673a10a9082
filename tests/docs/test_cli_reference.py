"""Every `kvrelay` subcommand and flag is documented.

tests/docs/test_docs_snippets.py checks that what the docs name exists; this is the other way:
a subcommand is named as `kvrelay NAME` in README.md or docs/*.md (docs/operations.md, Commands,
lists each with where it is described), and each of its long flags appears in those docs (or
benchmarks/README.md, the reference of `kvrelay bench`), so a new flag cannot ship unmentioned.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from kvrelay.node.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


def subcommands() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        for name, p in sub.choices.items()
    }


def undocumented(text: str, commands: dict[str, set[str]]) -> list[str]:
    missing = []
    for name, flags in commands.items():
        if not re.search(rf"`kvrelay {re.escape(name)}\b", text) and not re.search(
            rf"^kvrelay {name}\b", text, re.M
        ):
            missing.append(f"kvrelay {name}")
        missing += [
            f"kvrelay {name} {flag}" for flag in sorted(flags) if not re.search(rf"{flag}(?![\w-])", text)
        ]
    return missing


def test_every_subcommand_and_flag_is_documented() -> None:
    text = "\n".join(p.read_text() for p in DOCS)
    assert undocumented(text, subcommands()) == []


def test_the_check_sees_a_new_subcommand_and_a_new_flag() -> None:
    text = "\n".join(p.read_text() for p in DOCS)
    commands = {**subcommands(), "rebalance": {"--dry-run"}}
    commands["status"] = commands["status"] | {"--watch-forever"}
    assert undocumented(text, commands) == [
        "kvrelay status --watch-forever",
        "kvrelay rebalance",
        "kvrelay rebalance --dry-run",
    ]
