"""Every repository path the docs name exists.

The docs cite tests as evidence ("tests/e2e/test_replica_retry.py kills a DiT mid-denoise"),
scripts to run and configs to start from; a renamed or removed file leaves a claim nobody can
check and a command that fails. `test_docs_snippets.test_links_between_docs_resolve` covers
Markdown links and backticked configs/monitoring/dataset paths; this covers every path under a
top-level folder of the repository, backticked or not.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.test_docs_snippets import DOC_FILES

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("configs", "monitoring", "benchmarks", "tests", "scripts", "compose", "protos",
           "kvrelay", "broker", "ar_service", "dit_service", "client")  # fmt: skip
# A path not preceded by part of another path, a URL or a variable ($TMPDIR/kvrelay-up-*/).
PATH = re.compile(rf"(?<![\w./$-])((?:{'|'.join(FOLDERS)})/[\w./-]*[\w/])")
# Paths the docs name that are not in the repository, on purpose.
NOT_IN_THE_REPO = {
    "compose/kvrelay.env": "the operator writes it from compose/kvrelay.env.example; never committed",
    "kvrelay/configs/": "where an installed wheel keeps the shipped configs",
    "kvrelay/data/": "where an installed wheel keeps the prompt dataset",
}


def test_every_path_the_docs_name_exists() -> None:
    missing = sorted(
        f"{doc.relative_to(REPO)} names {name}"
        for doc in [*DOC_FILES, REPO / "docs" / "design.md", REPO / "benchmarks" / "README.md"]
        for name in set(PATH.findall(doc.read_text()))
        if name not in NOT_IN_THE_REPO and not (REPO / name).exists()
    )
    assert missing == [], f"paths the docs name that do not exist: {missing}"


def test_every_exception_is_still_named() -> None:
    named = {
        name for doc in [*DOC_FILES, REPO / "docs" / "design.md"] for name in PATH.findall(doc.read_text())
    }
    assert sorted(set(NOT_IN_THE_REPO) - named) == [], "exceptions no doc names any more: drop them"
