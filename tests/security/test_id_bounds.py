"""The interceptor's bound on id fields (kvrelay.security.check_id_lengths, run on every RPC of
every server before the servicer): a request_id is held to kvrelay.limits' bound (128 characters)
and refused with the broker's own words for it, whichever RPC and service carries it; every other
id to MAX_ID_CHARS (256). Before, any request_id up to 256 characters passed the interceptor and one
past it was refused as "longer than 256 characters", a bound no generation id has."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvrelay.errors import KvRelayServerError
from kvrelay.limits import MAX_REQUEST_ID_LENGTH, request_id_problem
from kvrelay.security import MAX_ID_CHARS, check_id_lengths
from kvrelay.v1 import ar_pb2, broker_pb2, dit_pb2, generation_pb2

# Every request message that carries a request_id: the public API's and the replica RPCs'.
CARRIERS: dict[str, Any] = {
    "Generate": generation_pb2.GenerateRequest,
    "GetGeneration": generation_pb2.GetGenerationRequest,
    "CancelGeneration": generation_pb2.CancelGenerationRequest,
    "CreateTicket": broker_pb2.CreateTicketRequest,
    "Prefill": ar_pb2.PrefillRequest,
    "Denoise": dit_pb2.DenoiseRequest,
}


def refusal(message: Any) -> KvRelayServerError:
    with pytest.raises(KvRelayServerError) as info:
        check_id_lengths(message)
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    return info.value


@pytest.mark.parametrize("rpc", sorted(CARRIERS))
def test_request_id_is_bounded_as_kvrelay_limits_says(rpc: str) -> None:
    make = CARRIERS[rpc]
    check_id_lengths(make(request_id="k" * MAX_REQUEST_ID_LENGTH))  # the longest valid id passes
    for length in (MAX_REQUEST_ID_LENGTH + 1, MAX_ID_CHARS, MAX_ID_CHARS + 1, 5000):
        rid = "k" * length
        refused = refusal(make(request_id=rid))
        # The broker's message for the same id (broker/generation.py, the SDK: kvrelay.limits).
        assert refused.message == f"request_id: {request_id_problem(rid)}", rpc
        assert f"at most {MAX_REQUEST_ID_LENGTH} characters" in refused.message
        assert f"got {length} characters" in refused.message
        assert refused.metadata == {"field": "request_id"}


def test_other_ids_keep_the_id_bound() -> None:
    # A ticket or replica id is not a generation id: 256 characters pass, 257 do not.
    check_id_lengths(ar_pb2.PrefillRequest(ticket_id="t" * MAX_ID_CHARS, request_id="r"))
    check_id_lengths(broker_pb2.CreateTicketRequest(ar_replica_id="a" * MAX_ID_CHARS))
    refused = refusal(ar_pb2.PrefillRequest(ticket_id="t" * (MAX_ID_CHARS + 1), request_id="r"))
    assert refused.message == f"ticket_id: longer than {MAX_ID_CHARS} characters"
    refused = refusal(broker_pb2.CreateTicketRequest(request_id="r", dit_replica_id="d" * (MAX_ID_CHARS + 1)))
    assert refused.message == f"dit_replica_id: longer than {MAX_ID_CHARS} characters"
