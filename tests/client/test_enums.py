"""The SDK's public IntEnums are the proto's enums: numbers from the stubs, members checked."""

from __future__ import annotations

from enum import IntEnum

import pytest

from kvrelay.client import types
from kvrelay.v1 import common_pb2


@pytest.mark.parametrize("kind, proto, prefix", types.MIRRORS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_public_enum_has_exactly_its_proto_enums_members(
    kind: type[IntEnum], proto: object, prefix: str
) -> None:
    assert {m.name: m.value for m in kind} == {
        name.removeprefix(prefix): number
        for name, number in proto.items()  # type: ignore[attr-defined]
    }
    # A value this client does not know (a newer server) decodes to UNSPECIFIED.
    assert types._enum(kind, 10_000) == kind(0)


def test_a_public_enum_that_differs_from_its_proto_fails_naming_each_member() -> None:
    class Stale(IntEnum):
        UNSPECIFIED = 0
        OK = 1
        GONE = 99

    with pytest.raises(ImportError) as info:
        types.check_mirrors(((Stale, common_pb2.WriteStatus, "WRITE_STATUS_"),))
    # Whatever the proto has now beyond UNSPECIFIED and OK (it grows: IN_DOUBT came later).
    names = sorted(n.removeprefix("WRITE_STATUS_") for n in common_pb2.WriteStatus.keys())
    missing = [n for n in names if n not in ("UNSPECIFIED", "OK")]
    assert "FAILED" in missing
    assert f"add {missing}, drop ['GONE']" in str(info.value)
