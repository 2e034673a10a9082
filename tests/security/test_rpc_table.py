"""Every RPC of every kvrelay server has a caller class, and docs/operations.md lists it.

Walks the service descriptors by reflection (kvrelay's generated modules, health, reflection), so
a new RPC that nobody classified fails here before it ships open or closed by accident.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

import kvrelay.v1
from kvrelay.security import RPC_RULES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
ROW = re.compile(r"^\| `(/[\w.]+/\w+)` \| ([\w ,]+) \| (.+) \|$")


def served_rpcs() -> set[str]:
    """Full method names of every RPC a kvrelay process serves."""
    modules = [
        importlib.import_module(f"kvrelay.v1.{m.name}")
        for m in pkgutil.iter_modules(kvrelay.v1.__path__)
        if m.name.endswith("_pb2")
    ]
    modules += [health_pb2, reflection_pb2]
    names = set()
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                names.add(f"/{service.full_name}/{method.name}")
    return names


def documented_rows() -> dict[str, str]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = ROW.match(line.strip())
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def test_every_served_rpc_has_a_caller_class() -> None:
    served = served_rpcs()
    assert len(served) > 20, sorted(served)  # the walk found the services
    missing = sorted(served - set(RPC_RULES))
    assert not missing, f"RPCs without a caller class in kvrelay.security.RPC_RULES: {missing}"


def test_docs_operations_lists_every_rpc_with_its_class() -> None:
    rows = documented_rows()
    missing = sorted(served_rpcs() - set(rows))
    assert not missing, f"RPCs missing from the table in docs/operations.md: {missing}"
    for method, rule in RPC_RULES.items():
        assert method in rows, f"{method} is classified but not documented"
        documented = {c.strip() for c in rows[method].split(",")}
        assert rule.caller_class.value in documented, (method, rows[method], rule.caller_class)
        assert ("operator" in documented) == (rule.operator_too and rule.caller_class.value != "public"
                                              or rule.caller_class.value == "operator"), (method, rows[method])
        assert ("always open" in documented) == rule.always_open, (method, rows[method])
    stale = sorted(set(rows) - set(RPC_RULES))
    assert not stale, f"docs/operations.md lists RPCs no server classifies: {stale}"
