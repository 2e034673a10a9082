"""Every command and snippet in README.md and docs/ is run, or listed here with why not.

Python blocks (and the examples in the SDK's docstrings, `client/*.py`) run as scripts and bash
blocks as `bash -euo pipefail` scripts, in a fresh folder,
against one live node (broker + AR + DiT from tests/configs/test-fast.yaml): the docs' broker
address (`127.0.0.1:50051`, `localhost:50051`, a client built without a target, a `kvrelay`
command without `--target`) is pointed at that node. A block or a line the test cannot run here
(a GPU, the network, minutes of CPU, a second node on the default ports) must be listed in
NOT_RUN or SKIPPED_LINES with the test that covers it instead, so a new snippet is never
silently untested. Links between docs must resolve to files in the repository, and every
`kvrelay` command the docs name (prose and untagged blocks included) must exist with its flags.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# docs/design.md and the seed are the contract and its source, quoted, not instructions to run.
QUOTED = {"design.md", "seed-mooncake-kv-transfer.md"}
DOC_FILES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in QUOTED)]

_REFERENCE = "API reference (signatures with elisions), not a runnable snippet; the module's own tests cover it"
# Blocks not run, by (file, how the block's first non-empty line starts).
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "./scripts/quickstart.sh "):
        "installs into .venv and starts a node on the default ports; its steps are the ones run here",
    ("README.md", "./scripts/test.sh"): "the whole suite (this test is part of it)",
    ("docs/operations.md", "pip install "):
        "needs the network and a CUDA 13 image; tests/foundation/test_shipped_files.py installs the wheel",
    ("docs/operations.md", "kvrelay up "):
        "a second node on the default ports; tests/supervisor/test_up_real_node.py runs `kvrelay up`",
    ("docs/operations.md", "kvrelay broker --config configs/single-node.yaml"):
        "one process per terminal on the default ports; tests/foundation/test_grpc_surface.py starts "
        "`kvrelay broker`, tests/dit_service and tests/ar_service start `kvrelay dit|ar`",
    ("README.md", "# 1. kvrelay up: "):
        "a node on the default ports, and Docker: tests/supervisor/test_up_real_node.py runs `kvrelay up`, "
        "scripts/compose_smoke.sh (tests/compose/) runs the compose steps",
    ("docs/operations.md", "python - .kvrelay/broker.sqlite "):
        "reads a node's journal where the node was started (here the docs node's is elsewhere); "
        "tests/broker/test_journal_compaction.py checks the same counts and pragmas",
    ("docs/operations.md", "( umask 077; set -o noclobber"):
        "writes compose/kvrelay.env of a checkout; tests/compose/test_compose_file.py runs it in a scratch "
        "folder and checks the tokens against the secret and that compose takes the file",
    ("docs/operations.md", "docker compose -f compose/docker-compose.yml --env-file compose/kvrelay.env --profile cpu up"):
        "Docker or podman: scripts/compose_smoke.sh runs these steps end to end (tests/compose/)",
    ("docs/operations.md", "kvrelay status                    # dit-1: UP no"):
        "needs a replica that is down for good (the docs node's are up); tests/broker/test_forget_replica.py "
        "runs `kvrelay forget ID...` and `--all-down` against a real broker",
    ("docs/transfer.md", "# DiT rank (receiver): its page pool is a device tensor"):
        "two CUDA devices' worth of API (CUDA IPC); " + _REFERENCE,
    ("docs/bagel.md", "kvrelay up --config my-bagel.yaml"):
        "needs the BAGEL-7B-MoT checkpoint and a GPU; tests/bagel/ load a tiny release-layout checkpoint",
    ("docs/bagel.md", "./scripts/quickstart.sh "): "as README.md's quickstart",
    ("docs/bagel.md", "python scripts/train_demo.py "):
        "minutes of CPU training; the demo model's tests judge what the shipped weights draw",
    ("docs/broker.md", "from kvrelay.broker.core import "): _REFERENCE,
    ("docs/dit.md", "# kvrelay/models/paged_attention.py"): _REFERENCE,
    ("docs/internals.md", "DTypeName = "): _REFERENCE,
    ("docs/internals.md", "@dataclass(frozen=True, slots=True)"): _REFERENCE,
    ("docs/models.md", "lock = ReplicaLock("): _REFERENCE,
    ("docs/transfer.md", "from kvrelay.transfer.pack import pack_staging"): _REFERENCE,
    ("docs/transfer.md", "from kvrelay.transfer.checksum import verify_write_until"): _REFERENCE,
    ("docs/transfer.md", "from kvrelay.transfer.transport import "): _REFERENCE,
}  # fmt: skip
# Lines of run blocks that are left out, by their command.
SKIPPED_LINES: dict[str, str] = {
    "kvrelay up": "a second node on the default ports; tests/supervisor/test_up_real_node.py runs it",
    "kvrelay verify": "tests/bench/test_verify.py runs it",
    "kvrelay bench": "minutes of CPU at its defaults; tests/bench/test_bench.py runs it on a tiny workload",
}


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    lang: str
    body: str

    @property
    def key(self) -> tuple[str, str]:
        first = next((ln for ln in self.body.splitlines() if ln.strip()), "")
        return (self.file, first.rstrip())

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def doc_blocks() -> list[Block]:
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S):
            if match.group(1) in ("python", "bash"):
                line = text[: match.start()].count("\n") + 1
                found.append(Block(str(path.relative_to(REPO)), line, match.group(1), match.group(2)))
    return found


def sdk_docstring_blocks(*, fragments: bool = False) -> list[Block]:
    """The examples in the SDK's docstrings (`client/*.py`: its module, classes and methods): an
    indented block that starts with an import, as `help(KvRelayClient)` shows them. They were
    never run: a renamed method would have left `help()` teaching code that fails. `fragments`:
    the blocks after a `::` line that do not import (`with client.generate(...) as handle:`),
    which need a client to run and are only parsed."""
    if fragments:
        return [b for b in _docstring_blocks(r"::\n\n((?: {4}.*\n|\n)+)") if not re.match(r"(from|import) ", b.body)]
    return _docstring_blocks(r"(?:^|\n)\n((?: {4}(?:from|import) .*\n)(?:(?: {4}.*)?\n)*)")


def _docstring_blocks(pattern: str) -> list[Block]:
    found = []
    for path in sorted((REPO / "client").glob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc is None:
                continue
            start = node.body[0].lineno  # the docstring's first line
            for match in re.finditer(pattern, doc + "\n"):
                body = textwrap.dedent(match.group(1)).strip("\n") + "\n"
                line = start + doc[: match.start(1)].count("\n")
                found.append(Block(str(path.relative_to(REPO)), line, "python", body))
    return found


def not_run_reason(block: Block) -> str | None:
    file, first = block.key
    return next((why for (f, start), why in NOT_RUN.items() if f == file and first.startswith(start)), None)


def runnable() -> list[Block]:
    return [b for b in doc_blocks() + sdk_docstring_blocks() if not_run_reason(b) is None]


def test_every_block_is_run_or_listed_with_a_reason() -> None:
    blocks = doc_blocks()
    used = {(f, start) for (f, start) in NOT_RUN for b in blocks if b.file == f and b.key[1].startswith(start)}
    # A stale entry would silently excuse a future block that happens to start the same way.
    assert used == set(NOT_RUN), f"NOT_RUN lists blocks no doc has any more: {sorted(set(NOT_RUN) - used)}"
    assert len(runnable()) >= 10


def test_the_sdks_docstring_examples_are_found_and_parse() -> None:
    blocks = sdk_docstring_blocks()
    # The package's, KvRelayClient's and AsyncKvRelayClient's (help(kvrelay.client) shows the first).
    assert {b.file for b in blocks} >= {"client/__init__.py", "client/sync.py", "client/aio.py"}, blocks
    for block in blocks:
        tree = ast.parse(block.body, filename=str(block))  # a bad indent or a typo fails here, fast
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "kvrelay.client"
                    for a in n.names}  # fmt: skip
        import kvrelay.client

        assert imported and imported <= set(kvrelay.client.__all__), f"{block}: {imported}"
    fragments = sdk_docstring_blocks(fragments=True)
    assert any(b.file == "client/sync.py" for b in fragments), fragments  # GenerationHandle's
    for block in fragments:
        ast.parse(block.body, filename=str(block))


def test_links_between_docs_resolve() -> None:
    missing = []
    for path in DOC_FILES + [REPO / "docs" / "design.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(REPO)} -> {target}")
        for name in re.findall(r"`((?:configs|monitoring|benchmarks/data)/[\w./-]+)`", path.read_text()):
            if not (REPO / name).exists():
                missing.append(f"{path.relative_to(REPO)} names {name}")
    assert missing == []


def _section_labels(doc: Path) -> list[str]:
    """What a "docs/X.md, Section" reference may name: a heading, a bold label, a `name`."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    labels = re.findall(r"^#+ (.*)$", text, re.M) + re.findall(r"\*\*([^*\n]+)\*\*", text)
    return [re.sub(r"[`*]", "", label).strip().lower() for label in labels] + [
        name.lower() for name in re.findall(r"`([^`\n]+)`", text)
    ]


def test_section_references_name_a_section_of_that_page() -> None:
    """Docs, code and tests point at a section in prose (docs/ + "operations.md, Security" or
    "operations.md (Security)"), which no link check sees: benchmarks/README.md sent readers to a
    "Mooncake facts" section of transfer.md that it no longer has."""
    pattern = re.compile(r"docs/([a-z_]+\.md)(?:, | \()((?:[A-Z]|`)[^)\];:,.\n\"]*)")
    sources = {*DOC_FILES}
    for folder in ("kvrelay", "broker", "ar_service", "dit_service", "client", "benchmarks", "scripts", "tests"):
        sources |= {p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")}
    labels: dict[str, list[str]] = {}
    checked, wrong = 0, []
    for source in sorted(sources):
        for doc, section in pattern.findall(source.read_text(errors="replace")):
            if not (REPO / "docs" / doc).exists():
                continue  # test_links_between_docs_resolve's business
            name = re.sub(r"[`*]", "", section).strip().lower()
            # "docs/broker.md, Journal and restart says ..." names "Journal and restart".
            name = re.sub(r"\s+(says|below|above|has|for|and|is|lists)\b.*$", "", name)
            known = labels.setdefault(doc, _section_labels(REPO / "docs" / doc))
            checked += 1
            if not any(label.startswith(name) for label in known):
                wrong.append(f"{source.relative_to(REPO)}: docs/{doc}, {section.strip()}")
    assert checked >= 50 and wrong == []


def test_every_kvrelay_command_in_the_docs_is_a_real_subcommand_with_real_flags() -> None:
    """Prose and untagged blocks are not run, so a renamed flag or subcommand survives there:
    every `kvrelay SUBCOMMAND ...` in backticks or a code block must name a subcommand of the CLI
    and only flags its parser has (`kvrelay replicas` once stood for `kvrelay status`)."""
    import argparse

    from kvrelay.node.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    wrong = []
    for path in DOC_FILES + [REPO / "benchmarks" / "README.md"]:
        text = path.read_text()
        spans = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S) + re.findall(r"`([^`\n]+)`", text)
        for span in spans:
            for line in span.splitlines():
                line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]  # a shell comment is prose
                for m in re.finditer(r"(?:^|[\s(|;&])kvrelay ([a-z][\w-]*)((?: +(?:\"[^\"]*\"|'[^']*'|[^\s|;&)`]+))*)", line):
                    command, args = m.group(1), re.sub(r"\$\([^)]*\)", "", m.group(2))
                    if command not in flags:
                        wrong.append(f"{path.relative_to(REPO)}: kvrelay {command}: no such subcommand")
                        continue
                    for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", args):
                        if flag not in flags[command]:
                            wrong.append(f"{path.relative_to(REPO)}: kvrelay {command} {flag}: no such flag")
    assert wrong == []


def _benchmark_scripts() -> list[str]:
    text = "".join(p.read_text() for p in [*DOC_FILES, REPO / "benchmarks" / "README.md"])
    return sorted(set(re.findall(r"\bbenchmarks/[\w/]+\.py\b", text)))


_HELP_TEST = "test_every_benchmark_script_the_docs_name_answers_help"

# `python SCRIPT --help` of each script named on the command line, each in a process forked from
# this one once it has imported torch: what each script imports and does is its own (a fresh
# __main__, argv and sys.path[0] as `python SCRIPT` has them), only torch's import (~2 s of CPU,
# most of a --help) is paid once. Prints {script: [exit code, stdout, stderr]} as JSON.
_FORKED_HELPS = """
import json, os, runpy, sys, tempfile, traceback
import torch  # noqa: F401

results = {}
for script in sys.argv[1:]:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = 0
            try:
                sys.argv = [script, "--help"]
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, int) and stop.code is not None:
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        results[script] = [os.waitstatus_to_exitcode(status), out.read(), err.read()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def benchmark_helps(request: pytest.FixtureRequest) -> dict[str, tuple[int, str, str]]:
    """Every script's `--help` (exit code, stdout, stderr) that the session runs the test below
    for: one at a time, each `python SCRIPT --help` imported torch again (27 scripts, ~45 s)."""
    scripts = sorted({item.callspec.params["script"] for item in request.session.items
                      if getattr(item, "originalname", None) == _HELP_TEST})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _FORKED_HELPS, *[s for s in scripts if (REPO / s).is_file()]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {script: (code, out, err) for script, (code, out, err) in json.loads(done.stdout).items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", _benchmark_scripts())
def test_every_benchmark_script_the_docs_name_answers_help(
    script: str, benchmark_helps: dict[str, tuple[int, str, str]]
) -> None:
    # `python benchmarks/journal_size.py --help` was `ValueError: invalid literal for int()`, and
    # unread_replies.py's an IndexError traceback: they read sys.argv by position.
    assert (REPO / script).is_file(), script
    code, out, err = benchmark_helps[script]
    assert code == 0 and "usage:" in out, err[-2000:]


# ------------------------------------------------------------------------------------ running


@pytest.fixture(scope="module")
def node_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvrelay.node.supervisor import start_node

    tmp = tmp_path_factory.mktemp("docs-node")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp / "journal.sqlite")
    data["stages"][1]["max_num_seqs"] = 2  # a batch snippet sends several at once
    path = tmp / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    with start_node(path, log_dir=tmp / "logs", ready_timeout=240, cwd=tmp) as node:
        yield node.address()


def point_at(text: str, address: str, lang: str) -> str:
    text = text.replace("127.0.0.1:50051", address).replace("localhost:50051", address)
    text = text.replace('"tests/configs/test-fast.yaml"', repr(str(REPO / "tests/configs/test-fast.yaml")))
    if lang == "python":
        return re.sub(r"\b((?:Async)?KvRelayClient)\(\)", rf'\1("{address}")', text)
    lines = []
    for line in text.splitlines():
        command = line.split("#", 1)[0].strip()
        skipped = next((p for p in SKIPPED_LINES if command == p or command.startswith(p + " ")), None)
        if skipped is not None:
            lines.append(f": skipped: {command}")
            continue
        if "--target" not in line:
            line = re.sub(r"\bkvrelay (generate|status|list|cancel|forget)\b", rf"kvrelay \1 --target {address}", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable(), ids=str)
def test_the_snippet_runs(block: Block, node_address: str, tmp_path: Path) -> None:
    script = point_at(block.body, node_address, block.lang)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    argv = [sys.executable, "-c", script] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", script]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, f"{block} failed:\n{script}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
