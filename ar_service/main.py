"""`kvrelay ar --config FILE --replica N`: one AR replica process.

Start-up order (docs/internals.md): take the replica lock (proof that no process of an older
incarnation is alive), bind the gRPC port and print `kvrelay ar listening on HOST:PORT`, start one
worker per TP rank (model shard + staging buffer registered with a fresh transport endpoint),
register with the broker under a fresh incarnation id, then turn health SERVING. Heartbeats run
until SIGTERM (clean stop: NOT_SERVING, deregister so no new tickets come while heartbeats go on,
let running requests finish their writes and reports, stop workers, exit 0) or a fail stop (fenced, superseded, a worker died: stop workers
first, which unregisters their memory, then exit 3 so a supervisor restarts the replica).
SIGTERM, SIGINT and SIGHUP are a clean stop in every phase: a wait at start-up (the replica lock,
the model load, registration retries against a broker not yet up) ends at once (kvrelay/stopping.py)
and the process stops what it started and exits 0. A second signal is a fast stop: the ranks are
killed at once (what a write of theirs still does is the broker's to settle, as after a crash:
IN_DOUBT until a new incarnation proves them gone), the drain is cut, nothing is deregistered or
reported, and the process exits 4 (EXIT_FAST_STOP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import uuid

from kvrelay.ar_service.engine import ArRankSpec
from kvrelay.ar_service.vllm_engine import VllmRankSpec
from kvrelay.broker_credential import BrokerCredentialWatch, credential_fix
from kvrelay.config import ConfigError, KvRelayConfig, SecurityConfig, StageConfig, load_config
from kvrelay.errors import broker_unreachable_line
from kvrelay.logging import capture_native_output, configure_logging, flush_native_output, get_logger
from kvrelay.replica_token import ReplicaToken
from kvrelay.security import (
    CallerClass,
    Credentials,
    SecurityError,
    load_credentials,
    replica_token_file_for,
    replica_token_source,
    require_bound_credential,
    tls_files,
)
from kvrelay.server import GrpcServer
from kvrelay.server_tls import CertificateFiles, broker_channel, check_server_pair, watched_certificates
from kvrelay.stopping import (
    EXIT_FAST_STOP,
    ProcessStop,
    StopRequested,
    exit_without_teardown,
    run_on_own_thread,
)
from kvrelay.v1 import ar_pb2_grpc

log = get_logger(__name__)

EXIT_OK = 0
EXIT_STARTUP = 1
EXIT_CONFIG = 2
EXIT_FAIL_STOP = 3
# How long a clean stop lets running Prefills finish their writes and reports.
STOP_GRACE_S = 30.0


def _broker_address(args: argparse.Namespace, cfg: KvRelayConfig) -> str:
    if getattr(args, "broker", None):
        return str(args.broker)
    return f"{cfg.broker.host}:{cfg.broker.port}"


def _rank_spec(
    stage: StageConfig, security: SecurityConfig | None = None, replica_id: str = "",
    tls_files: CertificateFiles | None = None,
) -> ArRankSpec | VllmRankSpec:
    security = security or SecurityConfig.model_validate({})
    if stage.model.engine == "vllm":
        from kvrelay.ar_service.vllm_engine import vllm_rank_spec

        spec = vllm_rank_spec(stage)
        # vLLM's workers build the connector from plain config: it loads the same credentials
        # (kvrelay.security) to dial DiT replicas over PutKv as this replica.
        spec.transfer["kv_connector_extra_config"].update(
            security=security.model_dump(mode="json"), replica_id=replica_id
        )
        return spec
    transport = stage.transport
    if transport not in ("mooncake", "grpc", "cuda_ipc"):
        raise ConfigError(
            f"stages[0].kv_transfer_config.kv_connector: the AR does not support {transport!r} yet"
        )
    from kvrelay.models.formats import model_dir

    return ArRankSpec(
        preset=stage.model.preset if model_dir(stage.model) is None else None,
        path=model_dir(stage.model),
        model_format=stage.model.format,
        weight_seed=stage.model.weight_seed,
        dtype=stage.model.dtype,
        transport=transport,
        hostname=stage.advertise_host,
        protocol=stage.mooncake_protocol,
        device_name=str(stage.extra.get("device_name", "")),
        # The per-worker memory budget of the stage is this rank's staging buffer.
        staging_bytes=stage.kv_cache_memory_bytes,
        # PutKv (the fallback transport) dials DiT replicas as this replica; each command brings
        # its bearer (Credentials.put_kv_channel).
        channel_security=load_credentials(security, replica_id).put_kv_channel(replica_id),
        # A new PutKv channel presents the certificate the files hold then (kvrelay.server_tls).
        tls_files=tls_files,
    )


async def serve(args: argparse.Namespace, cfg: KvRelayConfig) -> int:
    # First: a signal from here on is a clean stop, whatever the process is waiting for.
    stop = ProcessStop("ar")
    stop.install()
    from kvrelay.ar_service.engine import DescribeRank, RankDescription
    from kvrelay.ar_service.registration import (
        ArIdentity,
        ArRegistration,
        BrokerUnreachable,
        Fenced,
        RegistrationRefused,
        ReplicaIdInUse,
    )
    from kvrelay.ar_service.sender import broker_stub
    from kvrelay.ar_service.service import AR_SERVICE, ArMetrics, ArReplicaState, ArServicer
    from kvrelay.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
    from kvrelay.worker import (
        DeviceUnavailable,
        ReplicaLock,
        WorkerGroup,
        check_devices,
        collective_timeout_s,
        replica_lock_path,
        watch_ranks,
    )

    stage = cfg.ar_stage
    replica = int(args.replica)
    if not 0 <= replica < stage.num_replicas:
        print(f"kvrelay ar: --replica {replica} outside [0, {stage.num_replicas}) of stages[0].num_replicas",
              file=sys.stderr)  # fmt: skip
        return EXIT_CONFIG
    replica_id = f"ar-{replica}"
    try:
        creds = load_credentials(cfg.security, replica_id)
        require_bound_credential(creds, replica_id)
        if creds.tls is not None:
            # A pair its peers refuse (expired, another CA's): found black-box, the replica started,
            # never registered and logged only DEADLINE_EXCEEDED until its 120 s wait gave up.
            check_server_pair(creds.tls, f"{replica_id}: {tls_files(cfg.security, replica_id)}")
        # The certificate served and presented, taken again when its files are replaced.
        certificates = watched_certificates(cfg.security, replica_id, creds.tls)
        rank_spec = _rank_spec(stage, cfg.security, replica_id,
                               certificates.files if certificates is not None else None)
    except (ConfigError, SecurityError) as err:
        print(f"kvrelay ar: {err}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        check_devices(stage.devices_for(replica), f"stages[0] ({replica_id}) devices")
    except DeviceUnavailable as err:
        print(f"kvrelay ar: {err}", file=sys.stderr)
        return EXIT_CONFIG
    host = args.host or stage.host
    port = stage.port_for(replica) if args.port is None else args.port
    metrics_port = stage.metrics_port_for(replica) if args.metrics_port is None else args.metrics_port
    incarnation_id = uuid.uuid4().hex

    # Wait out a previous incarnation's workers (they die with their parent, within moments).
    stop.phase = "waiting for the replica lock"
    lock = ReplicaLock(replica_lock_path(replica_id, deployment=_broker_address(args, cfg)))
    try:
        await stop.until_stopped(
            asyncio.to_thread(lock.acquire, timeout_s=max(10.0, 2 * cfg.broker.lease_seconds), cancel=stop.thread_event),
            abort=stop.thread_event.set,
        )
    except StopRequested:
        lock.release()
        return EXIT_OK

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    # Rank labels as the ranks report them: vLLM's engine reports for its TP workers as rank 0.
    ranks = 1 if isinstance(rank_spec, VllmRankSpec) else stage.tensor_parallel_size
    metrics = ArMetrics.create(registry, mooncake_ranks=ranks if stage.transport == "mooncake" else 0)
    stop_reason: list[str] = []
    fail_stop = asyncio.Event()

    def on_fail_stop(reason: str) -> None:
        if not fail_stop.is_set():
            log.error("fail_stop", replica_id=replica_id, reason=reason)
            stop_reason.append(reason)
            fail_stop.set()

    async def on_credential_refused(refused: bool) -> None:
        # Not ready while the broker refuses our token (a readiness probe and `kvrelay health`
        # see it); ready again once it takes it, unless stopping meanwhile.
        metrics.credential_refused.set(1 if refused else 0)
        if refused or (stop.phase == "serving" and not fail_stop.is_set() and not stop.requested):
            await server.set_serving(not refused)

    # The token as the process holds it now: re-read from its file when the broker refuses it
    # (a rotated secret); a swap reaches the server, the registration and the broker channel at once.
    token = ReplicaToken(replica_id, creds, replica_token_source(replica_token_file_for(cfg.security, replica_id),
                                                        cfg.security.replica_token_env))  # fmt: skip
    channel = broker_channel(_broker_address(args, cfg), creds.channel(CallerClass.REPLICA, replica_id), certificates,
                             live_metadata=token.broker_metadata)  # fmt: skip
    stub = broker_stub(channel)
    servicer = ArServicer(stub, metrics, on_fail_stop)
    server = GrpcServer(
        name=replica_id,
        host=host,
        port=port,
        metrics_port=metrics_port,
        metrics_registry=registry,
        registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server, servicer, AR_SERVICE)],
        credentials=creds,
        insecure_bind=bool(getattr(args, "insecure_bind", False)),
        server_certificates=certificates,
    )
    try:
        await server.start()
    except SecurityError as err:
        print(f"kvrelay ar: {err}", file=sys.stderr)
        await channel.close()
        lock.release()
        return EXIT_CONFIG
    # Answered from now on: the broker's proof that this incarnation is alive when another
    # process registers under our id (docs/operations.md, Across hosts).
    await server.announce_incarnation(incarnation_id)
    print(f"kvrelay ar listening on {server.address}", flush=True)

    if isinstance(rank_spec, VllmRankSpec):
        from kvrelay.ar_service.vllm_engine import engine_env

        # One process hosts vLLM's engine; vLLM runs its own TP workers.
        group = WorkerGroup(
            1,
            rank_spec,
            devices=stage.devices_for(replica)[:1],
            lock=lock,
            env=engine_env(stage.model.vllm_args),
            name=f"kvrelay-{replica_id}",
        )
    else:
        group = WorkerGroup(
            stage.tensor_parallel_size,
            rank_spec,
            devices=stage.devices_for(replica),
            lock=lock,
            name=f"kvrelay-{replica_id}",
            # A rank stopped under rank_stall_seconds mid-collective must not time its peers out.
            dist_timeout_s=collective_timeout_s(cfg.rank_stall_seconds_for(stage)),
        )
    # A fast stop kills the ranks at once: it ends any command in flight (a prefill, a write)
    # and every wait on one, and their memory registrations die with them.
    killing: list[asyncio.Future[None]] = []
    stop.on_fast(lambda: killing.append(run_on_own_thread(group.kill, f"kvrelay-{replica_id}-fast-stop")))
    registration: ArRegistration | None = None
    heartbeats: asyncio.Task[None] | None = None
    watchdog: asyncio.Future[None] | None = None
    code = EXIT_OK
    deregistered = False
    try:
        # A stop during the model load kills the ranks (nothing of theirs is registered with the
        # broker yet): the load cannot be interrupted otherwise, and may take minutes.
        stop.phase = "loading the model"
        await stop.until_stopped(asyncio.to_thread(group.start), abort=group.kill)
        infos: list[RankDescription] = await stop.until_stopped(
            asyncio.to_thread(group.call_all, DescribeRank()), abort=group.kill
        )
        first = infos[0]
        if isinstance(rank_spec, VllmRankSpec):
            from kvrelay.ar_service.vllm_engine import service_tokenizer
            from kvrelay.ar_service.vllm_tokenizer import DescribeTokenizer, EngineTokenizer

            # vLLM's own tokenizer, described by its engine process: the service runs its pipeline
            # without torch when that gives vLLM's ids (docs/ar.md, "The service's tokenizer").
            (engine_tokenizer,) = await stop.until_stopped(
                asyncio.to_thread(group.call_all, DescribeTokenizer()), abort=group.kill
            )
            assert isinstance(engine_tokenizer, EngineTokenizer)
            tokenizer: Tokenizer = service_tokenizer(engine_tokenizer, stage.model.tokenizer or rank_spec.path)
        else:
            tokenizer = load_tokenizer(stage.model.tokenizer, model=stage.model)
            if stage.model.path is not None and isinstance(tokenizer, ByteTokenizer) and first.vocab != tokenizer.vocab_size:
                # A checkpoint of another vocabulary prefilled byte ids computes a prefix of noise, silently.
                log.warning("byte_tokenizer_for_checkpoint", path=str(stage.model.path), model_vocab=first.vocab,
                            fix="set model.tokenizer: DIR (its tokenizer.json), or put tokenizer.json in model.path")
        state = ArReplicaState(
            replica_id=replica_id,
            incarnation_id=incarnation_id,
            group=group,
            tokenizer=tokenizer,
            max_tokens=first.max_tokens,
            vocab=first.vocab,
            tensor_parallel_size=stage.tensor_parallel_size,
            transport=stage.transport,
            transfer_timeout_s=stage.transfer_timeout,
            request_timeout_s=stage.request_timeout_seconds,
            # Tickets waiting while a prefill runs share the next one (up to max_num_seqs) when
            # the engine takes several per command (the built-in one; vLLM's takes one).
            max_prefill_batch=stage.max_num_seqs if first.prefill_batch_tokens > 0 else 1,
            max_prefill_batch_tokens=first.prefill_batch_tokens,
            cache_blocks=first.cache_blocks,
            cache_block_size=first.cache_block_size,
            put_kv_bearer=token.put_kv_bearer,
        )
        servicer.attach(state)
        assert servicer.reporter is not None
        identity = ArIdentity(
            replica_id=replica_id,
            incarnation_id=incarnation_id,
            endpoint=f"{stage.advertise_host}:{server.bound_port}",
            num_layers=first.num_layers,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            dtype=first.dtype,
            page_size=cfg.dit_stage.page_size,
            tensor_parallel_size=stage.tensor_parallel_size,
            max_tokens=first.max_tokens,
            transport=stage.transport,
            stage_id=stage.stage_id,
            max_num_seqs=stage.max_num_seqs,
        )
        registration = ArRegistration(
            stub,
            identity,
            servicer.ledger,
            servicer.reporter,
            heartbeat_interval_s=cfg.broker.heartbeat_interval,
            token=creds.replica_token,
            on_fail_stop=on_fail_stop,
            credential=BrokerCredentialWatch(replica_id, on_change=on_credential_refused, token=token),
        )

        def on_token_swap(new: Credentials, registration: ArRegistration = registration) -> None:
            server.replace_credentials(new)
            registration.token = new.replica_token or ""

        token.on_swap = on_token_swap
        stop.phase = f"registering with the broker at {_broker_address(args, cfg)}"
        try:
            await stop.until_stopped(
                registration.register(
                    broker=_broker_address(args, cfg), wait_s=cfg.broker.register_wait_seconds,
                    in_use_wait_s=2 * cfg.broker.lease_seconds,
                )
            )
        except Fenced as err:
            on_fail_stop(str(err))
        except BrokerUnreachable as err:
            log.error("broker_unreachable", broker=_broker_address(args, cfg), code=err.code, message=err.message)
            line = broker_unreachable_line(_broker_address(args, cfg), err.waited_s, err.code, err.message)
            print(f"kvrelay ar: {line}", file=sys.stderr)
            return EXIT_STARTUP
        except ReplicaIdInUse as err:
            # Another process of this id serves (another host, another lock folder): starting this
            # one again would be refused the same way, and must never take the id from it.
            log.error("registration_refused", code=err.code, reason=err.reason, message=err.message)
            print(f"kvrelay ar: the broker refused registration: {err}", file=sys.stderr)
            deregistered = True  # never registered: nothing of the live one's to touch on the way out
            return EXIT_CONFIG
        except RegistrationRefused as err:
            log.error("registration_refused", code=err.code, reason=err.reason, message=err.message)
            fix = f"; {credential_fix(replica_id, err.reason)}" if err.code == "UNAUTHENTICATED" else ""
            print(f"kvrelay ar: the broker refused registration: {err}{fix}", file=sys.stderr)
            return EXIT_STARTUP
        if not fail_stop.is_set() and not stop.requested:
            stop.phase = "serving"
            await server.set_serving(True)
            log.info(
                "ar_serving",
                replica_id=replica_id,
                incarnation=incarnation_id,
                ranks=[(i.rank, i.pid, i.device, i.session) for i in infos],
                transport=stage.transport,
            )
            heartbeats = asyncio.ensure_future(registration.run())
            # A stopped or dead rank fail-stops the replica even in the middle of a command
            # (a prefill or write waits for its ranks without a deadline): its writes go to the
            # broker as lost with the incarnation, instead of every request timing out on it.
            watchdog = asyncio.ensure_future(
                watch_ranks(group, on_fail_stop, interval_s=cfg.rank_watch_interval,
                            max_silence_s=cfg.rank_stall_seconds_for(stage))
            )
            stopped = asyncio.ensure_future(stop.event.wait())
            failed = asyncio.ensure_future(fail_stop.wait())
            await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            failed.cancel()
        if fail_stop.is_set():
            code = EXIT_FAIL_STOP
        else:
            # Clean stop: no new requests; running ones finish their writes and reports.
            stop.phase = "draining"
            await server.set_serving(False)
            if registration is not None and heartbeats is not None:
                # Deregistered first so the broker hands out no new tickets; heartbeats go on (the
                # broker keeps polling a deregistered writer) until the running writes are reported.
                deregistered = await stop.unless_fast(registration.deregister())
            await stop.unless_fast(servicer.drain(STOP_GRACE_S))
    except StopRequested:
        # Stopped before serving: nothing was handed out; what started is stopped below.
        code = EXIT_OK
    except Exception as err:  # noqa: BLE001 - any start-up failure ends the process with a message
        log.exception("ar_failed", replica_id=replica_id)
        print(f"kvrelay ar: {type(err).__name__}: {err}", file=sys.stderr)
        code = EXIT_STARTUP
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if registration is not None:
            registration.stop()
        if heartbeats is not None:
            heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await heartbeats
        if stop.fast_requested and code in (EXIT_OK, EXIT_FAIL_STOP):
            code = EXIT_FAST_STOP
        if code in (EXIT_FAIL_STOP, EXIT_FAST_STOP):
            # Workers first: their memory registrations die with them, and no write of ours can
            # be in flight afterwards. Then nothing else is trusted: exit without deregistering
            # (a fast stop too: to the broker it is a crash, its in-doubt writes stay held).
            if code == EXIT_FAST_STOP:
                await (killing[0] if killing else run_on_own_thread(group.kill, f"kvrelay-{replica_id}-fast-stop"))
            else:
                await asyncio.to_thread(group.stop)
        else:
            if registration is not None and not deregistered:
                await stop.unless_fast(registration.deregister())
            # A fast stop requested meanwhile kills the ranks, which ends this at once.
            await asyncio.to_thread(group.stop)
            if stop.fast_requested:
                code = EXIT_FAST_STOP
                await killing[0]
        await server.stop(grace=1.0, fast=stop)
        await channel.close()
        lock.release()
        log.info(
            "ar_stopped",
            replica_id=replica_id,
            exit_code=code,
            reason=stop_reason[0] if stop_reason else None,
        )
    return code


def run(args: argparse.Namespace) -> int:
    replica = getattr(args, "replica", 0)
    configure_logging(args.log_level, process=f"ar-{replica}")
    capture_native_output(f"ar-{replica}")
    try:
        cfg = load_config(args.config)
        if getattr(args, "advertise_host", None) is not None:
            cfg = cfg.with_advertise_host("ar", args.advertise_host)
    except ConfigError as err:
        print(f"kvrelay ar: {err}", file=sys.stderr)
        return EXIT_CONFIG
    from kvrelay.ports import PortInUse, unresolvable_host

    where = "--advertise-host" if getattr(args, "advertise_host", None) is not None else "stages[0].advertise_host"
    problem = unresolvable_host(cfg.ar_stage.advertise_host, where)
    if problem is not None:
        print(f"kvrelay ar: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    from kvrelay.worker import LockTimeout

    try:
        code = asyncio.run(serve(args, cfg))
    except (ConfigError, PortInUse, LockTimeout) as err:
        # Configuration and deployment errors: one line, and an exit code the supervisor does
        # not restart (the same start would fail the same way).
        print(f"kvrelay ar: {err}", file=sys.stderr)
        # No interpreter teardown: a gRPC server of a failed start, freed by its last garbage
        # collection, joined grpc.aio's stopped poller thread for ever (kvrelay.broker.main.run).
        exit_without_teardown(EXIT_CONFIG)
    sys.stdout.flush()
    if code in (EXIT_FAIL_STOP, EXIT_FAST_STOP):
        # Fail or fast stop: do not run interpreter teardown that could block on a wedged thread.
        flush_native_output()
        os._exit(code)
    # Everything is stopped and logged: no interpreter teardown to wait for (seconds, with torch).
    exit_without_teardown(code)
