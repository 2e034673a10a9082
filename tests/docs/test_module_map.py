"""docs/internals.md's module map names every module of the product, and only modules that exist.

A module added without a row is one a reader of the map never finds (this session's
`kvrelay/replica_token.py`, `kvrelay/broker_credential.py` and `kvrelay/suggest.py` had none);
a row for a module that was moved or removed sends them to nothing. Package `__init__.py` files
and the generated stubs (`kvrelay/v1/`, one row) need no row of their own.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kvrelay", "broker", "ar_service", "dit_service", "client")


def map_rows() -> set[str]:
    text = (REPO / "docs" / "internals.md").read_text()
    start = text.index("## Module map")
    block = text.index("```text", start)
    body = text[block + len("```text") : text.index("```", block + len("```text"))]
    return set(re.findall(r"^([\w/]+(?:\.py|/))(?:\s|$)", body, re.MULTILINE))


def product_modules() -> set[str]:
    return {
        p.relative_to(REPO).as_posix()
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if p.name != "__init__.py" and "v1" not in p.relative_to(REPO).parts
    }


def test_every_module_has_a_row() -> None:
    missing = sorted(product_modules() - map_rows())
    assert missing == [], f"modules without a row in docs/internals.md's module map: {missing}"


def test_every_row_names_a_file_that_exists() -> None:
    stale = sorted(row for row in map_rows() if not (REPO / row).exists())
    assert stale == [], f"docs/internals.md's module map names files that do not exist: {stale}"
