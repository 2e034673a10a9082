"""The KvRelayConnector refuses, when vLLM builds it (before any model loads), a TLS pair its
PutKv peers would refuse: the same check and one-line error as `kvrelay up`, `kvrelay ar` and
`kvrelay dit` (kvrelay.server_tls.check_server_pair). Built directly from a VllmConfig, no engine:
its start-up path is what is under test. Before, it started and every gRPC write failed at its
handshake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.security import SecurityError  # noqa: E402
from tests.security.certs import TestCa, install_pair  # noqa: E402

pytestmark = pytest.mark.slow


def _connector(transport: str, security: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvrelay.ar_service.vllm_connector import KvRelayConnector
    from kvrelay.ar_service.vllm_engine import CONNECTOR_MODULE

    extra = {"transport": transport, "replica_id": "ar-0", "security": security}
    transfer = KVTransferConfig(kv_connector="KvRelayConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                kv_role="kv_producer", kv_connector_extra_config=extra)  # fmt: skip
    return KvRelayConnector(VllmConfig(kv_transfer_config=transfer), KVConnectorRole.WORKER)


def test_the_connector_refuses_a_tls_pair_its_peers_would_refuse(tmp_path: Path) -> None:
    for sub in ("ca", "good", "expired", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    ca.folder = tmp_path / "good"
    good, other = ca.issue("ar-0"), ca.issue("dit-0")
    ca.folder = tmp_path / "expired"
    expired = ca.issue("ar-0", expired=True)
    live = tmp_path / "live"
    security = {"tls": {"cert_file": str(live / "{name}.pem"), "key_file": str(live / "{name}.key"),
                        "ca_file": str(ca.path), "require_client_cert": True}}  # fmt: skip
    files = (f"security.tls.cert_file ({live}/ar-0.pem), security.tls.key_file ({live}/ar-0.key), "
             f"security.tls.ca_file ({ca.path})")  # fmt: skip

    install_pair(live, "ar-0", good.cert, good.key)
    assert _connector("grpc", security) is not None  # a good pair starts

    install_pair(live, "ar-0", expired.cert, expired.key)
    with pytest.raises(SecurityError) as refused:
        _connector("grpc", security)
    assert str(refused.value) == (f"KvRelayConnector: ar-0: {files}: a client trusting security.tls.ca_file "
                                  "refuses this certificate (certificate has expired)")  # fmt: skip

    install_pair(live, "ar-0", good.cert, other.key)
    with pytest.raises(SecurityError, match=r"^KvRelayConnector: ar-0: .*: the key is not the certificate's$"):
        _connector("grpc", security)
    # Mooncake writes carry no TLS: the pair is not the connector's to check then.
    assert _connector("mooncake", security) is not None
