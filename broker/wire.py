"""How the broker's own enums travel on the wire: each maps onto its `kvrelay.v1` enum by name.

The proto is the one definition of every state's number. The broker's cores keep domain enums of
their own (tickets.py and registry.py may not import gRPC or the stubs: an import contract), with
members the wire does not carry (`WriteStatus.PENDING` is the proto's UNSPECIFIED). This module
builds both directions of each mapping from the member names and checks them when the servicer
module is imported: a proto value the broker lacks, or a broker member the proto lacks, fails with
the name to add, instead of a hand-written table silently missing it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class WireEnum(Generic[E]):
    """A domain enum's proto values (`to_pb`: the generated enum's value type, which message
    constructors accept) and back (`from_pb`; 0 only when a member stands for UNSPECIFIED)."""

    to_pb: Mapping[E, Any]
    from_pb: Mapping[int, E]


def wire_enum(domain: type[E], proto: Any, prefix: str, *, unspecified: E | None = None) -> WireEnum[E]:
    """Map `domain` onto the generated enum `proto` (e.g. `common_pb2.WriteStatus`) by name: member
    NAME is `prefix + NAME` on the wire; `unspecified`, if given, is the proto's 0."""
    wire: dict[str, int] = dict(proto.items())
    to_pb: dict[E, int] = {}
    for member in domain:
        name = prefix + ("UNSPECIFIED" if member is unspecified else member.name)
        if name not in wire:
            raise ImportError(f"{domain.__name__}.{member.name}: {proto.DESCRIPTOR.full_name} has no {name}")
        to_pb[member] = wire[name]
    missing = sorted(name for name, number in wire.items() if number and number not in to_pb.values())
    if missing:
        raise ImportError(
            f"{domain.__name__} has no member for {', '.join(missing)} of {proto.DESCRIPTOR.full_name}"
        )
    return WireEnum(to_pb, {number: member for member, number in to_pb.items()})


__all__ = ["WireEnum", "wire_enum"]
