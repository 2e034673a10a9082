"""The SDK refuses a generation's parameters exactly where and as the broker does: both check
kvrelay/limits.py. `kvrelay generate --steps -1` said "[0, 2**32)" (the wire's range) while the
broker's bound is [1, 1000]; the SDK now names the broker's bound, before sending anything.

Pure: the SDK's request builder (`new_generation`) against the broker's own validation
(`resolve_request`), value by value at and past every edge."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvrelay.broker.generation import resolve_request
from kvrelay.client._common import RetryPolicy
from kvrelay.client._core import new_generation
from kvrelay.client.errors import KvRelayError
from kvrelay.errors import KvRelayServerError
from kvrelay.v1 import generation_pb2

ARGUMENTS = ("seed", "width", "height", "num_inference_steps", "guidance_scale", "request_id")

# (field, value, the broker's message or None where it accepts the value)
SIDE = "must be a multiple of 16 in [64, 2048], got {}"
STEPS = "must be in [1, 1000], got {}"
GUIDANCE = "must be finite and >= 1.0 (1.0 = no CFG), got {}"
CASES: list[tuple[str, Any, str | None]] = [
    *[(side, v, None) for side in ("width", "height") for v in (64, 80, 2048)],
    *[(side, v, SIDE.format(v)) for side in ("width", "height") for v in (0, 48, 100, 2064, 4096)],
    *[("num_inference_steps", v, None) for v in (1, 2, 1000)],
    *[("num_inference_steps", v, STEPS.format(v)) for v in (0, 1001, 2**32 - 1)],
    *[("guidance_scale", v, None) for v in (1.0, 2.0, 1e300)],
    *[("guidance_scale", v, GUIDANCE.format(v)) for v in (0.0, 0.999, -1.0, math.inf, math.nan)],
    *[("seed", v, None) for v in (0, 2**63, 2**64 - 1)],
    *[("request_id", v, None) for v in ("r-1", "a" * 128, "A.b_c:d~e-9")],
]


def _sdk(field: str, value: Any) -> generation_pb2.GenerateRequest:
    kwargs = dict.fromkeys(ARGUMENTS)
    kwargs[field] = value
    core = new_generation("a fox", "", *(kwargs[a] for a in ARGUMENTS[:5]), kwargs["request_id"], None, RetryPolicy())
    return core.request


@pytest.mark.parametrize(("field", "value", "message"), CASES)
def test_the_sdk_refuses_what_the_broker_refuses_with_its_message(field: str, value: Any, message: str | None) -> None:
    broker_says: str | None = None
    try:
        resolve_request(generation_pb2.GenerateRequest(prompt="a fox", **{field: value}))
    except KvRelayServerError as err:
        assert (err.code.name, err.reason, err.metadata) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", {"field": field})
        broker_says = err.message
    assert broker_says == (None if message is None else f"{field}: {message}")
    if message is None:
        assert getattr(_sdk(field, value), field) == value or math.isnan(value)
        return
    with pytest.raises(KvRelayError) as info:
        _sdk(field, value)
    assert (info.value.code, info.value.reason, dict(info.value.details)) == (
        "INVALID_ARGUMENT", "INVALID_ARGUMENT", {"field": field}
    )
    assert info.value.message == broker_says


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_inference_steps", -1, STEPS.format(-1)),
        ("num_inference_steps", 2**33, STEPS.format(2**33)),
        ("width", -64, SIDE.format(-64)),
        ("seed", -1, "must be in [0, 2**64), got -1"),
        ("seed", 2**64, f"must be in [0, 2**64), got {2**64}"),
    ],
)
def test_values_the_wire_cannot_carry_name_the_brokers_bound_not_the_wires(field: str, value: int, message: str) -> None:
    with pytest.raises(KvRelayError) as info:
        _sdk(field, value)
    assert info.value.message == f"{field}: {message}" and dict(info.value.details) == {"field": field}
