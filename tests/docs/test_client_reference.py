"""docs/client.md's signatures are the SDK's.

Each `Name(...)` in backticks in docs/client.md that names a client class, one of its methods or
a dataclass of `kvrelay.client` must spell its parameters (names, order, defaults, the `*`) or
fields exactly as the code does; a method the doc leaves `timeout=` off may do so (the doc says
every method takes it). Every public method of the clients appears in the doc.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import kvrelay.client as sdk
from kvrelay.client import AsyncKvRelayClient, KvRelayClient

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "client.md"


def _split_top(text: str) -> list[str]:
    """`a, b=(1, 2), *, c` -> ["a", "b=(1, 2)", "*", "c"]: commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def real_parameters(func: object) -> list[str]:
    out = []
    seen_star = False
    for p in inspect.signature(func).parameters.values():  # type: ignore[arg-type]
        if p.name == "self":
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not seen_star:
            out.append("*")
            seen_star = True
        out.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return out


def _normal(param: str) -> str:
    # `name: Type` in a dataclass listing; quotes either way in a default.
    return re.sub(r"^(\w+): .*$", r"\1", param.strip()).replace('"', "'")


def drift(text: str | None = None) -> list[str]:
    text = DOC.read_text() if text is None else text
    methods = {n for n, _ in inspect.getmembers(KvRelayClient, inspect.isfunction) if not n.startswith("_")}
    wrong = []
    for name, args in re.findall(r"`([A-Za-z_]\w*)\(([^`]*)\)`", text):
        documented = [_normal(a) for a in _split_top(args)]
        if documented in ([], ["..."]) or any(d.endswith("=") for d in documented):
            continue  # `AsyncKvRelayClient(...)`, prose naming one keyword: `generate(timeout=)`
        if name in ("KvRelayClient", "AsyncKvRelayClient"):
            real = real_parameters(getattr(sdk, name).__init__)
        elif name in methods:
            real = real_parameters(getattr(KvRelayClient, name))
            if not any(d.startswith("timeout") for d in documented):
                real = [r for r in real if not r.startswith("timeout=")]
                real = real[:-1] if real and real[-1] == "*" else real
        elif dataclasses.is_dataclass(getattr(sdk, name, None)):
            cls = getattr(sdk, name)
            real = [f.name for f in dataclasses.fields(cls)]
            if "=" in args:  # RetryPolicy(max_attempts=4, ...): fields with their defaults
                real = [f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)]
        else:
            continue
        if [r.replace('"', "'") for r in real] != documented:
            wrong.append(
                f"{name}: docs/client.md says ({', '.join(documented)}), the code ({', '.join(real)})"
            )
    for name in sorted(methods):
        if f"`{name}(" not in text:
            wrong.append(f"{name}: a public method of KvRelayClient that docs/client.md does not list")
    return wrong


def test_the_client_doc_spells_every_signature_as_the_code() -> None:
    assert drift() == []


def test_the_asyncio_client_has_the_same_signatures() -> None:
    # The doc gives one signature for both clients ("same arguments").
    for name, func in inspect.getmembers(KvRelayClient, inspect.isfunction):
        if not name.startswith("_") or name == "__init__":
            assert real_parameters(func) == real_parameters(getattr(AsyncKvRelayClient, name)), name


def test_the_check_sees_a_wrong_default_a_missing_field_and_an_unlisted_method() -> None:
    text = DOC.read_text()
    assert any(
        "generate:" in w for w in drift(text.replace("num_inference_steps=2,", "num_inference_steps=4,", 1))
    )
    assert any(
        "Image:" in w for w in drift(text.replace("`Image(png, width, height, seed)`", "`Image(png, width)`"))
    )
    assert any("get_pools: a public method" in w for w in drift(text.replace("`get_pools(", "`pools(")))


def test_every_public_member_of_the_clients_and_handles_has_a_docstring() -> None:
    """`help(AsyncKvRelayClient)` showed six of its methods, and `KvRelayClient.list_replicas`,
    without a word (found walking the SDK as a new user)."""
    bare = []
    for cls in (KvRelayClient, AsyncKvRelayClient, sdk.GenerationHandle, sdk.AsyncGenerationHandle):
        inherited = {name: m for base in reversed(cls.__mro__[:-1]) for name, m in vars(base).items()}
        for name, member in inherited.items():
            if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            if not inspect.getdoc(member):
                bare.append(f"{cls.__name__}.{name}")
    assert bare == []
