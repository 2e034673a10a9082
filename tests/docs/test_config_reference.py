"""docs/configuration.md is the reference of every config key and environment variable.

Every key kvrelay/config.py accepts has a row in its section's table (first column, in
backticks), with its default where the key has one; every key a table documents is one the
config accepts (a renamed or removed key is an error at load, so a stale row sends users into
"unknown key"). Every environment variable the code reads (`os.environ.get`, `getenv`,
`setdefault`, a `*_ENV` name) appears in the Environment table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kvrelay.config import KV_CONNECTOR_EXTRA_KEYS, KvRelayConfig

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
SOURCES = ["kvrelay", "broker", "ar_service", "dit_service", "client"]
# Variables only tests set (fault hooks, Triton's CPU interpreter): not for users.
TEST_ONLY_ENV = {"KVRELAY_TEST_VLLM_PREFILL_FAULT", "TRITON_INTERPRET"}

# The doc's sections, by heading, and where each one's keys live in the config (a key under a
# nested model is written with its prefix: `tls.cert_file`, `model.engine`).
SECTIONS = {
    "Top level": (),
    "`broker`": ("broker",),
    "`security`": ("security",),
    "`stages[]`": ("stages",),
    "`kv_transfer_config`": ("stages", "kv_transfer_config"),
}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: `X`, `X | None`, `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        inner = _model_of(arg)
        if inner is not None:
            return inner
    return None


def section_model(path: tuple[str, ...]) -> type[BaseModel]:
    model: type[BaseModel] = KvRelayConfig
    for name in path:
        found = _model_of(model.model_fields[name].annotation)
        assert found is not None, name
        model = found
    return model


def config_keys(path: tuple[str, ...]) -> dict[str, Any]:
    """key (prefixed below the section) -> its default (PydanticUndefined when required).

    A nested model one level down (`security.tls`, `stages[].model`) contributes its own keys with
    a prefix instead of itself; a nested section of its own (`stages[].kv_transfer_config`) is
    left to that section, and so is the top level's `broker`, `security`, `stages`.
    """
    model = section_model(path)
    nested_sections = {
        p[len(path)] for p in SECTIONS.values() if len(p) == len(path) + 1 and p[: len(path)] == path
    }
    keys: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None and name not in nested_sections and path:
            for sub, sub_field in inner.model_fields.items():
                keys[f"{name}.{sub}"] = sub_field.default
            continue
        keys[name] = field.default
    if path == ("stages", "kv_transfer_config"):
        keys.pop("kv_connector_extra_config")
        for extra in KV_CONNECTOR_EXTRA_KEYS:
            keys[f"kv_connector_extra_config.{extra}"] = PydanticUndefined
    return keys


def doc_rows(text: str | None = None) -> dict[str, list[tuple[list[str], str]]]:
    """heading -> the rows of its table: (the backticked keys of the first column, the row)."""
    text = DOC.read_text() if text is None else text
    rows: dict[str, list[tuple[list[str], str]]] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            continue
        if heading in SECTIONS and line.startswith("| `"):
            first = line.split("|")[1]
            rows.setdefault(heading, []).append((re.findall(r"`([\w.]+)`", first), line))
    return rows


def _default_forms(value: Any) -> list[str]:
    if isinstance(value, bool):
        return [f"`{str(value).lower()}`"]
    if isinstance(value, int | float):
        forms = [f"`{value:g}`", f"`{value}`"]
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if isinstance(value, int) and value >= size and value % size == 0:
                forms.append(f"{value // size} {unit}")
        return forms
    if isinstance(value, str):
        return [f"`{value}`", f'`"{value}"`']
    if isinstance(value, tuple):
        return [f"`[{', '.join(value)}]`"]
    return []


def drift(text: str | None = None) -> list[str]:
    rows = doc_rows(text)
    wrong = []
    for heading, path in SECTIONS.items():
        keys = config_keys(path)
        documented: dict[str, str] = {}
        for names, line in rows.get(heading, []):
            for name in names:
                if name not in keys:
                    wrong.append(f"{heading}: `{name}` is documented but the config has no such key")
                documented[name] = line
        for key, default in keys.items():
            if key not in documented:
                wrong.append(f"{heading}: `{key}` is accepted by the config but has no row")
                continue
            forms = _default_forms(default)
            # The default column: a row naming several keys lists their defaults in order.
            cells = documented[key].split("|")
            if forms and len(cells) > 3 and not any(f in cells[2] for f in forms):
                wrong.append(f"{heading}: `{key}` defaults to {default!r}, its row says {cells[2].strip()!r}")
    return wrong


def test_every_config_key_is_documented_with_its_default_and_every_documented_key_exists() -> None:
    assert drift() == []


def test_the_check_sees_a_missing_row_a_stale_row_and_a_wrong_default() -> None:
    text = DOC.read_text()
    no_queue = "\n".join(ln for ln in text.splitlines() if not ln.startswith("| `max_queue`"))
    assert any("`max_queue` is accepted" in w for w in drift(no_queue))
    stale = text.replace("| `max_queue` |", "| `max_queued` |", 1)
    assert any("`max_queued` is documented" in w for w in drift(stale))
    wrong_default = text.replace("| `max_queue` | `256` |", "| `max_queue` | `512` |", 1)
    assert any("`max_queue` defaults to 256" in w for w in drift(wrong_default))
    assert "`kv_connector_extra_config.device_name` is accepted" in " ".join(
        drift(text.replace("| `kv_connector_extra_config.device_name`", "| device_name", 1))
    )


# ------------------------------------------------------------------------------ environment


def env_reads(tree: ast.AST) -> set[str]:
    """Names of environment variables a module reads or defaults: string literals given to
    os.environ.get/setdefault/[...], os.getenv, and module constants named *_ENV."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = node.func.value
            is_environ = isinstance(owner, ast.Attribute) and owner.attr == "environ"
            if (is_environ and node.func.attr in ("get", "setdefault", "pop")) or node.func.attr == "getenv":
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "environ"
        ):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.add(node.slice.value)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.endswith("_ENV"):
                    found.add(node.value.value)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            # {"tls_ca": "KVRELAY_TLS_CA", ...} under a *_ENV name, and GRPC_CORE_LOG_DEFAULTS-like
            # mappings of variables to the values kvrelay defaults them to.
            for target in node.targets:
                if isinstance(target, ast.Name) and (
                    target.id.endswith("_ENV") or target.id.endswith("_DEFAULTS")
                ):
                    for k, v in zip(node.value.keys, node.value.values, strict=True):
                        lit = v if target.id.endswith("_ENV") else k
                        if isinstance(lit, ast.Constant) and isinstance(lit.value, str):
                            found.add(lit.value)
    return {name for name in found if re.fullmatch(r"[A-Z][A-Z0-9_]*", name)}


def code_env() -> dict[str, str]:
    out: dict[str, str] = {}
    for root in SOURCES:
        for path in sorted((REPO / root).rglob("*.py")):
            if "v1" in path.relative_to(REPO).parts:
                continue
            for name in env_reads(ast.parse(path.read_text(), str(path))):
                out.setdefault(name, str(path.relative_to(REPO)))
    return {k: v for k, v in out.items() if k not in TEST_ONLY_ENV}


def environment_table(text: str | None = None) -> set[str]:
    text = DOC.read_text() if text is None else text
    section = text.split("\n## Environment", 1)[1].split("\n## ", 1)[0]
    return {name for line in section.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1])}  # fmt: skip


def test_every_environment_variable_the_code_reads_is_in_the_environment_table() -> None:
    env = code_env()
    for name in (
        "KVRELAY_CONFIG",
        "KVRELAY_LOCK_DIR",
        "KVRELAY_TLS_CA",
        "MC_TCP_BIND_ADDRESS",
        "GRPC_VERBOSITY",
    ):
        assert name in env, name  # each way of reading one is seen
    missing = {name: where for name, where in env.items() if name not in environment_table()}
    assert missing == {}, f"read by the code, not in docs/configuration.md, Environment: {missing}"


def test_the_environment_check_sees_a_new_variable() -> None:
    tree = ast.parse('import os\nx = os.environ.get("KVRELAY_SOMETHING_NEW", "1")')
    assert env_reads(tree) == {"KVRELAY_SOMETHING_NEW"}
    assert "KVRELAY_SOMETHING_NEW" not in environment_table()


# ------------------------------------------------------------------------ keys named elsewhere


def stale_key_references(texts: dict[str, str]) -> list[str]:
    """`broker.X`, `security.X`, `security.tls.X` named in backticks anywhere in the docs must be
    keys (a property such as `broker.heartbeat_interval` is not something a user can set). Only
    names with an underscore are checked: `broker.log` is a file, `broker.service` a module."""
    from kvrelay.config import _MOVED_BROKER_KEYS, BrokerConfig, SecurityConfig, TlsConfig

    known = {
        "broker": set(BrokerConfig.model_fields) | set(_MOVED_BROKER_KEYS),
        "security": set(SecurityConfig.model_fields),
    }
    wrong = []
    for name, text in texts.items():
        for m in re.finditer(r"`(broker|security)\.([a-z][a-z_]*)(?:\.([a-z][a-z_]*))?", text):
            section, key, sub = m.groups()
            line = text[: m.start()].count("\n") + 1
            if (
                "_" in key.strip("_") and not key.endswith("_") and key not in known[section]
            ):  # `api_token_*`: a family
                wrong.append(f"{name}:{line}: {section}.{key} is not a config key")
            if section == "security" and key == "tls" and sub and sub not in TlsConfig.model_fields:
                wrong.append(f"{name}:{line}: security.tls.{sub} is not a config key")
    return wrong


def test_every_config_key_the_docs_name_exists() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert stale_key_references({str(p.relative_to(REPO)): p.read_text() for p in docs}) == []


def test_the_key_reference_check_sees_a_property_and_a_wrong_tls_key() -> None:
    text = "every `broker.heartbeat_interval`; `security.tls.cert_path`; `broker.log`; `broker.lease_seconds`"
    assert stale_key_references({"t.md": text}) == [
        "t.md:1: broker.heartbeat_interval is not a config key",
        "t.md:1: security.tls.cert_path is not a config key",
    ]
