"""`kvrelay broker`: the broker process.

Serves BrokerService (registry, pages, tickets) and GenerationService (the public API) on one
port, with health, reflection and metrics from kvrelay.server. Never imports torch or a model
service: it talks to AR and DiT replicas over gRPC only.

SIGTERM, SIGINT and SIGHUP stop it gracefully (live generations fail `BROKER_SHUTTING_DOWN`, RPCs
get their grace, the journal is closed, exit 0); a second signal cuts the grace (exit
EXIT_FAST_STOP, kvrelay/stopping.py) and still closes the journal. Nothing of the page accounting
depends on which: every change is committed to the journal before it is revealed, so a cut stop,
like a crash, restarts from what the disk holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import sys

from prometheus_client import CollectorRegistry

from kvrelay.broker.authz import broker_checks
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.credential_grace import CredentialGraceStore
from kvrelay.broker.credential_reload import BrokerSecrets
from kvrelay.broker.generation import GenerationServicer
from kvrelay.broker.journal import JournalInUse, JournalOpenError, JournalWriteError
from kvrelay.broker.metrics import register_broker_metrics
from kvrelay.broker.orchestrator import Orchestrator
from kvrelay.broker.service import (
    BrokerServicer,
    grpc_endpoint_probe,
    grpc_incarnation_probe,
    replica_authentication,
)
from kvrelay.broker.waiters import run_maintenance
from kvrelay.config import ConfigError, KvRelayConfig, load_config
from kvrelay.logging import capture_native_output, configure_logging, get_logger
from kvrelay.ports import PortInUse
from kvrelay.security import (
    BROKER_CALLER_ID,
    CallerClass,
    CredentialRefusals,
    CredentialRotation,
    Credentials,
    SecurityError,
    load_credentials,
    require_bound_credential,
)
from kvrelay.server import GrpcServer
from kvrelay.server_tls import ServerCertificates
from kvrelay.stopping import EXIT_FAST_STOP, ProcessStop, exit_without_teardown
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, generation_pb2, generation_pb2_grpc

log = get_logger(__name__)

BROKER_SERVICE = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


async def serve(
    cfg: KvRelayConfig,
    host: str,
    port: int,
    metrics_port: int | None,
    credentials: Credentials | None = None,
    insecure_bind: bool = False,
) -> int:
    """Serve until a stop signal; the exit code: 0, or EXIT_FAST_STOP when a second signal cut
    the graceful stop. Raises what ends it otherwise (a journal failure, a port in use)."""
    b = cfg.broker
    creds = credentials if credentials is not None else load_credentials(cfg.security)
    # What the broker takes and presents across `kvrelay rotate-secrets` (its server's checks,
    # its calls to replicas, the write tokens it hands out, the registration token).
    rotation = CredentialRotation(creds)
    secrets = BrokerSecrets(cfg.security, rotation)
    try:
        core = BrokerCore(
            b.journal_path,
            lease_seconds=b.lease_seconds,
            drain_quiet_seconds=b.drain_quiet_seconds,
            receiver_settle_seconds=cfg.receiver_settle_seconds,
            receiver_proof_window_seconds=cfg.receiver_proof_window_seconds,
            registration_token=creds.replica_token,
            verify_checksums=cfg.dit_stage.verify_checksums,
            # Commits are written by the journal's own thread, several per fsync, and every reply
            # waits for its record (docs/broker.md, Journal and restart): no fsync on the loop.
            journal_group_commit=True,
            max_replicas=b.max_replicas,
            max_total_pages=b.max_total_pages,
            forget_down_after_seconds=b.forget_down_replicas_after_seconds,
        )
    except JournalWriteError:
        raise  # the journal opened but its replay could not be written (disk full): not a setting
    except (JournalInUse, JournalOpenError) as err:
        # A directory, a parent that is a file, a file that is not a journal, another broker's.
        raise ConfigError(f"broker.journal_path: {err}") from None
    except (OSError, sqlite3.Error) as err:
        # Anything else of the open (the journal reports its own as JournalOpenError): the
        # operator's setting, named, not a traceback (nothing is listening yet).
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"broker.journal_path: cannot open the journal {b.journal_path!r}: {reason}") from None
    # Fail stop: a failed journal write leaves memory ahead of disk, so the process exits and
    # its supervisor starts it again from what the disk holds (as a failed maintenance pass does).
    core.registration_tokens = rotation.shared_replica_tokens
    # A rotation's grace outlives a broker restart: the replaced generations, sealed, in the
    # journal (broker/credential_grace.py), recorded at each change, taken back now.
    grace_store = CredentialGraceStore(core.journal, rotation)
    grace_store.restore()
    rotation.on_change = grace_store.save_quietly
    secrets.persisted = core.journal.durable
    # The server's certificate and key, swapped by `kvrelay rotate-secrets` (kvrelay.server_tls).
    server_certificates = ServerCertificates(creds.tls) if creds.tls is not None else None
    secrets.server_certificates = server_certificates
    journal_failed = asyncio.Event()
    core.journal.on_failure = lambda _err: journal_failed.set()
    registry = CollectorRegistry()
    ticket_ttl = max(cfg.ar_stage.request_timeout_seconds, cfg.dit_stage.request_timeout_seconds)
    # Registrations are checked by dialling the advertised endpoint as the orchestrator will.
    # Asked at each probe: a TLS client certificate reloaded by `kvrelay rotate-secrets` is used.
    endpoint_probe = grpc_endpoint_probe(lambda: rotation.current.channel(CallerClass.REPLICA, BROKER_CALLER_ID))
    # A new incarnation takes a replica id only when the registered one does not answer at its
    # endpoint (docs/operations.md, Across hosts): asked the same way.
    incarnation_probe = grpc_incarnation_probe(lambda: rotation.current.channel(CallerClass.REPLICA, BROKER_CALLER_ID))
    refusals = CredentialRefusals()
    orchestrator = Orchestrator(core, cfg, registry, credential_rotation=rotation,
                                server_certificates=server_certificates)  # fmt: skip
    broker_servicer = BrokerServicer(
        core, ticket_ttl, endpoint_probe, incarnation_probe=incarnation_probe,
        max_watch_streams=b.max_watch_streams, max_watch_streams_per_replica=b.max_watch_streams_per_replica,
        replica_authentication=replica_authentication(creds), credential_refusals=refusals, secrets=secrets,
        generation_state=orchestrator.generation_state,
    )  # fmt: skip
    register_broker_metrics(core, registry, broker_servicer.rpc_counts, secrets)
    server = GrpcServer(
        name="broker",
        host=host,
        port=port,
        metrics_port=metrics_port,
        registrations=[
            (broker_pb2_grpc.add_BrokerServiceServicer_to_server, broker_servicer, BROKER_SERVICE),
            (
                generation_pb2_grpc.add_GenerationServiceServicer_to_server,
                GenerationServicer(orchestrator),
                GENERATION_SERVICE,
            ),
        ],
        metrics_registry=registry,
        credentials=creds,
        checks=broker_checks(core),
        insecure_bind=insecure_bind,
        credential_refusals=refusals,
        server_certificates=server_certificates,
        credential_rotation=rotation,
    )
    try:
        await server.start()
    except BaseException:
        # A port in use: nothing served yet. The journal is closed here (its lock released, its
        # writer joined), not left to the interpreter's teardown with the rest (see run).
        core.close()
        raise
    # SIGHUP too: its default action killed the broker outright, as a closed terminal would.
    process_stop = ProcessStop("broker")
    process_stop.install()
    maintenance = asyncio.create_task(run_maintenance(core), name="broker-maintenance")
    await orchestrator.start()
    await server.set_serving(True)
    print(f"kvrelay broker listening on {server.address}", flush=True)
    process_stop.phase = "serving"
    stop = asyncio.create_task(process_stop.event.wait())
    failed = asyncio.create_task(journal_failed.wait())
    try:
        # A failed maintenance pass (journal error) stops the process: memory would run ahead of disk.
        done, _ = await asyncio.wait({stop, maintenance, failed}, return_when=asyncio.FIRST_COMPLETED)
        if maintenance in done:
            maintenance.result()
        if core.journal.failure is not None:
            log.error("broker_journal_failed", path=core.journal.path, reason=core.journal.failure.reason)
            raise core.journal.failure
    finally:
        process_stop.phase = "draining"
        for task in (stop, failed):
            task.cancel()
        # A fast stop skips the wait for the cancelled pipelines and the RPCs' grace; each core
        # change they made is committed already, and the journal is closed below either way.
        if not await process_stop.unless_fast(orchestrator.stop()):
            await orchestrator.stop(grace_s=0.0)  # still fail and cancel what runs; wait for none
        await server.stop(grace=2.0, fast=process_stop)
        maintenance.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await maintenance
        core.close()
    if process_stop.fast_requested:
        log.warning("broker_stopped_fast", exit_code=EXIT_FAST_STOP)
        return EXIT_FAST_STOP
    return 0


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, process="broker")
    capture_native_output("broker")
    try:
        cfg = load_config(args.config)
        creds = load_credentials(cfg.security)
        require_bound_credential(creds, BROKER_CALLER_ID)
    except (ConfigError, SecurityError) as err:
        print(f"kvrelay broker: {err}", file=sys.stderr)
        return 2
    host = args.host or cfg.broker.host
    port = cfg.broker.port if args.port is None else args.port
    metrics_port = cfg.broker.metrics_port if args.metrics_port is None else args.metrics_port
    try:
        code = asyncio.run(serve(cfg, host, port, metrics_port, creds, bool(getattr(args, "insecure_bind", False))))
    except PortInUse as err:
        print(f"kvrelay broker: {err}", file=sys.stderr)
        code = 1
    except JournalWriteError as err:
        # Exit 1, not 2: a full disk may be freed, so the supervisor starts it again (with backoff).
        print(f"kvrelay broker: broker.journal_path: {err}; stopping to recover from the journal", file=sys.stderr)
        code = 1
    except (SecurityError, ConfigError) as err:
        print(f"kvrelay broker: {err}", file=sys.stderr)
        code = 2
    # Failed or stopped, no interpreter teardown either way: a start that failed (a port in use)
    # left its gRPC server in a garbage cycle, and the teardown's last collection freed it after
    # the daemon threads were stopped: grpc.aio's shutdown joined its poller thread, which never
    # ended. Some such brokers, started at once against one port, hung after their error line.
    exit_without_teardown(code)
