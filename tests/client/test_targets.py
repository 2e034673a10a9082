"""Targets without a port get the broker's default port (gRPC alone would dial 443)."""

from __future__ import annotations

import pytest

from kvrelay.client import KvRelayClient
from kvrelay.client._common import normalize_target


@pytest.mark.parametrize(
    ("given", "dialed"),
    [
        ("localhost", "localhost:50051"),
        ("localhost:", "localhost:50051"),
        ("broker.example.com", "broker.example.com:50051"),
        ("10.0.0.7", "10.0.0.7:50051"),
        ("10.0.0.7:6000", "10.0.0.7:6000"),
        ("::1", "[::1]:50051"),
        ("[::1]", "[::1]:50051"),
        ("[::1]:6000", "[::1]:6000"),
        ("dns:localhost", "dns:localhost:50051"),
        ("dns:///broker", "dns:///broker:50051"),
        ("dns://8.8.8.8/broker:7000", "dns://8.8.8.8/broker:7000"),
        ("unix:/run/kvrelay.sock", "unix:/run/kvrelay.sock"),
        ("ipv4:127.0.0.1:6000", "ipv4:127.0.0.1:6000"),
        ("", "127.0.0.1:50051"),
    ],
)
def test_default_port_is_filled_in(given: str, dialed: str) -> None:
    assert normalize_target(given) == dialed


def test_clients_dial_the_normalized_target() -> None:
    with KvRelayClient("localhost") as client:
        assert client.target == "localhost:50051"


@pytest.mark.parametrize("url", ["http://127.0.0.1:50051", "https://broker.example.com:443/", "grpc://localhost:7000"])
def test_a_url_is_refused_naming_the_host_port_it_holds(url: str) -> None:
    # `--target http://127.0.0.1:50051` (kvrelay up prints its metrics endpoints as URLs) was
    # dialed as the IPv6 host "[http://127.0.0.1:50051]:50051": a DNS failure naming neither.
    from kvrelay.client import KvRelayError

    with pytest.raises(KvRelayError) as err:
        KvRelayClient(url)
    assert (err.value.code, err.value.details) == ("INVALID_ARGUMENT", {"field": "target"})
    rest = url.split("://", 1)[1].rstrip("/")
    assert err.value.message.startswith(f"target: {url!r} is a URL; a kvrelay target is HOST:PORT (here {rest!r}; ")
