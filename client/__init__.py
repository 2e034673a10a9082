"""kvrelay.client: the Python SDK for a kvrelay node (blocking and asyncio).

    from kvrelay.client import KvRelayClient

    with KvRelayClient("127.0.0.1:50051") as client:
        handle = client.generate("a red fox in the snow", seed=7)
        for event in handle.events():
            print(event.state.name, event.step, event.total_steps)
        handle.result().save("fox.png")

Users get handles, dataclasses, IntEnums and one exception type (`KvRelayError`); no protobuf
type appears in this API. This package imports only the generated `kvrelay.v1` stubs, grpc and
its own modules (no torch, no config, no service package), so it runs anywhere.
"""

from __future__ import annotations

from ._common import (
    DEFAULT_GENERATE_TIMEOUT,
    DEFAULT_RPC_TIMEOUT,
    DEFAULT_TARGET,
    MAX_MESSAGE_BYTES,
    RetryPolicy,
)
from .aio import AsyncGenerationHandle, AsyncKvRelayClient
from .errors import KvRelayError
from .sync import GenerationHandle, KvRelayClient
from .types import (
    CredentialRefusal,
    CredentialSourceReload,
    CredentialsReload,
    ErrorStatus,
    ForgottenIncarnation,
    Generation,
    GenerationEvent,
    GenerationPage,
    GenerationParams,
    GenerationResult,
    GenerationState,
    Image,
    KvGeometry,
    LoadProgress,
    PhaseTimings,
    PoolStatus,
    Replica,
    ReplicaRegistry,
    ReplicaRole,
    RowPages,
    Ticket,
    TicketOutcome,
    TicketState,
    TransportKind,
    WriteProgress,
    WriteStatus,
)

__all__ = [
    "DEFAULT_GENERATE_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT",
    "DEFAULT_TARGET",
    "MAX_MESSAGE_BYTES",
    "AsyncGenerationHandle",
    "AsyncKvRelayClient",
    "CredentialRefusal",
    "ErrorStatus",
    "ForgottenIncarnation",
    "Generation",
    "GenerationPage",
    "GenerationEvent",
    "GenerationHandle",
    "GenerationParams",
    "GenerationResult",
    "GenerationState",
    "Image",
    "KvGeometry",
    "KvRelayClient",
    "KvRelayError",
    "LoadProgress",
    "PhaseTimings",
    "PoolStatus",
    "Replica",
    "CredentialSourceReload",
    "CredentialsReload",
    "ReplicaRegistry",
    "ReplicaRole",
    "RetryPolicy",
    "RowPages",
    "Ticket",
    "TicketOutcome",
    "TicketState",
    "TransportKind",
    "WriteProgress",
    "WriteStatus",
]
