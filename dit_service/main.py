"""`kvrelay dit --config FILE --replica N`: one DiT replica process.

Owns the order of start and stop. Start: take the replica lock (proof that no process of the
previous incarnation is alive), bind the gRPC port (and print `kvrelay dit listening on
HOST:PORT`), allocate the page pools, start the rank workers (each builds its model and registers
its pool with the transport), register with the broker, heartbeat, and only then turn health
SERVING. Stop on SIGTERM/SIGINT/SIGHUP: NOT_SERVING, drain the server, deregister, stop the
workers, free the pools, exit 0; a signal during a start-up wait (the replica lock, the model load,
registration retries against a broker not yet up) ends that wait at once (kvrelay/stopping.py) and
the same stop follows. Fail stop (fenced, a rank died, a broken invariant): stop the workers
before the memory is unregistered and freed, then exit 3 so the supervisor restarts the replica.
A second signal is a fast stop: the ranks are killed at once (a Denoise in flight ends and its
ticket is released only after that, as a cancelled one is), the server's grace and the waits for
handlers and owed releases are cut, nothing is deregistered, the pools are freed only after the
ranks (whose transport endpoints receive into them) are gone, and the process exits 4
(EXIT_FAST_STOP). To the broker it is a crash: what it did not hear, a new incarnation settles.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from kvrelay.config import ConfigError, KvRelayConfig, ModelConfig, load_config
from kvrelay.errors import broker_unreachable_line
from kvrelay.logging import capture_native_output, configure_logging, flush_native_output, get_logger
from kvrelay.server import GrpcServer
from kvrelay.stopping import (
    EXIT_FAST_STOP,
    ProcessStop,
    StopRequested,
    exit_without_teardown,
    run_on_own_thread,
)
from kvrelay.v1 import dit_pb2, dit_pb2_grpc

log = get_logger(__name__)

DIT_SERVICE = dit_pb2.DESCRIPTOR.services_by_name["DitService"].full_name
EXIT_FAIL_STOP = 3
LOCK_WAIT_S = 30.0


class _Stopper:
    """Why the process stops: a clean request or a fail stop with its reason."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.fail_reason: str | None = None

    def fail_stop(self, reason: str) -> None:
        if self.fail_reason is None:
            self.fail_reason = reason
            log.error("fail_stop", reason=reason)
        self.event.set()


def model_max_image_side(model: ModelConfig) -> int:
    """The largest width or height in pixels a stage's model generates, registered so the broker
    refuses a larger image at admission (INVALID_ARGUMENT) instead of the DiT failing it: a
    BAGEL-format model's latent position table covers `max_latent_size` patches per side (1024
    pixels for BAGEL-7B and the demo); 0 for the presets (2D sin-cos positions: no limit)."""
    from kvrelay.models.formats import BAGEL_FORMATS, model_dir

    if model.format not in BAGEL_FORMATS:
        return 0
    from kvrelay.models.bagel_config import load_bagel_config  # JSON and safetensors headers: no torch

    directory = model_dir(model)
    assert directory is not None
    bagel = load_bagel_config(directory, dtype=model.dtype)
    return bagel.max_latent_size * bagel.latent_downsample


def _killer(group: Any, killing: list[asyncio.Future[None]], name: str) -> Callable[[], None]:
    """The fast stop's first act: kill the ranks on a thread of their own (kept in `killing`)."""
    return lambda: killing.append(run_on_own_thread(group.kill, name))


class PageMemoryUnavailable(Exception):
    """The host cannot map the configured page memory (kv_cache_memory_bytes)."""


async def serve(cfg: KvRelayConfig, args: argparse.Namespace) -> int:
    # First: a signal from here on is a clean stop, whatever the process is waiting for.
    stop = ProcessStop("dit")
    stop.install()
    from kvrelay.broker_credential import BrokerCredentialWatch
    from kvrelay.dit_service.engine import DescribeRegion, DitRankSpec, control_bytes
    from kvrelay.dit_service.memory import HostPool, ReplicaMemory, dit_geometry, remove_stale_pools
    from kvrelay.dit_service.registration import (
        BrokerUnreachable,
        DitReplicaInfo,
        Registration,
        ReplicaIdInUse,
        new_incarnation_id,
        replica_id_for,
    )
    from kvrelay.dit_service.scheduler import admission_slots
    from kvrelay.dit_service.service import DitMetrics, DitReplicaState, DitServicer, control_view
    from kvrelay.models.formats import model_dir
    from kvrelay.models.stage import stage_preset as model_preset
    from kvrelay.ports import PortInUse
    from kvrelay.replica_token import ReplicaToken
    from kvrelay.security import (
        CallerClass,
        Credentials,
        SecurityError,
        check_bind,
        load_credentials,
        replica_token_file_for,
        replica_token_source,
        require_bound_credential,
        tls_files,
    )
    from kvrelay.server_tls import broker_channel, check_server_pair, watched_certificates
    from kvrelay.transfer.transport import RegionDescriptor
    from kvrelay.v1 import broker_pb2_grpc
    from kvrelay.worker import (
        DeviceUnavailable,
        ReplicaLock,
        StallFreeRun,
        WorkerGroup,
        beat_stall_free_run,
        check_devices,
        collective_timeout_s,
        replica_lock_path,
        watch_ranks,
    )

    stage = cfg.dit_stage
    replica = args.replica
    replica_id = replica_id_for(replica)
    if not 0 <= replica < stage.num_replicas:
        print(f"kvrelay dit: --replica {replica} out of range: the DiT stage has {stage.num_replicas} replica(s)",
              file=sys.stderr)  # fmt: skip
        return 2
    if stage.model.format == "kvrelay" and stage.model.preset is None:
        print("kvrelay dit: stages[1].model.preset is required: it names the DiT's shape (path: DIR adds weights)",
              file=sys.stderr)  # fmt: skip
        return 2
    incarnation_id = new_incarnation_id()
    host = args.host or stage.host
    port = stage.port_for(replica) if args.port is None else args.port
    metrics_port = stage.metrics_port_for(replica) if args.metrics_port is None else args.metrics_port
    broker_address = args.broker or f"{cfg.broker.host}:{cfg.broker.port}"
    insecure_bind = bool(getattr(args, "insecure_bind", False))
    try:
        creds = load_credentials(cfg.security, replica_id)
        require_bound_credential(creds, replica_id)
        check_bind(host, creds, insecure_bind, f"kvrelay dit ({replica_id})")
        if creds.tls is not None:
            # A pair its peers refuse (expired, another CA's): found black-box, the replica started,
            # never registered and logged only DEADLINE_EXCEEDED until its 120 s wait gave up.
            check_server_pair(creds.tls, f"{replica_id}: {tls_files(cfg.security, replica_id)}")
        # The certificate served and presented, taken again when its files are replaced.
        certificates = watched_certificates(cfg.security, replica_id, creds.tls)
    except SecurityError as err:
        print(f"kvrelay dit: {err}", file=sys.stderr)
        return 2

    try:
        check_devices(stage.devices_for(replica), f"stages[1] ({replica_id}) devices")
    except DeviceUnavailable as err:
        print(f"kvrelay dit: {err}", file=sys.stderr)
        return 2
    lock = ReplicaLock(replica_lock_path(replica_id, deployment=broker_address))
    stop.phase = "waiting for the replica lock"
    try:
        await stop.until_stopped(
            asyncio.to_thread(lock.acquire, LOCK_WAIT_S, cancel=stop.thread_event), abort=stop.thread_event.set
        )
    except StopRequested:
        lock.release()
        return 0
    stale = remove_stale_pools(replica_id)
    if stale:
        log.info("stale_pools_removed", replica_id=replica_id, files=[p.name for p in stale])
    stopper = _Stopper()
    metrics = DitMetrics(replica_id)
    servicer = DitServicer()
    server = GrpcServer(
        name=replica_id, host=host, port=port, metrics_port=metrics_port, metrics_registry=metrics.registry,
        registrations=[(dit_pb2_grpc.add_DitServiceServicer_to_server, servicer, DIT_SERVICE)],
        credentials=creds, insecure_bind=insecure_bind, server_certificates=certificates,
    )
    try:
        await server.start()
    except PortInUse as err:
        # A failed start (a port in use): one line and exit 2, as the AR and the broker, nothing
        # started to stop. Before, the stop of a running replica followed it and logged three more
        # lines (fail_stop, grpc_stopped, dit_stopped). run() exits without interpreter teardown.
        print(f"kvrelay dit: {err}", file=sys.stderr)
        lock.release()
        return 2
    except Exception as err:  # noqa: BLE001 - as a failed start below: one line, exit 3
        log.exception("dit_failed", error=str(err))
        print(f"kvrelay dit: startup failed: {(str(err) or type(err).__name__).splitlines()[0]}", file=sys.stderr)
        lock.release()
        return EXIT_FAIL_STOP
    memory: ReplicaMemory | None = None
    control_pool: HostPool | None = None
    group: WorkerGroup | None = None
    registration: Registration | None = None
    channel = None
    watchdog: asyncio.Task[None] | None = None
    # This process receives too (the gRPC-stream fallback's PutKv): its own stall-free run,
    # reported with its ranks' in every heartbeat (docs/broker.md, Draining).
    process_run = StallFreeRun()
    process_beat = asyncio.get_running_loop().create_task(beat_stall_free_run(process_run), name="dit-process-beat")
    killing: list[asyncio.Future[None]] = []
    config_error = False
    try:
        # Answered from now on: the broker's proof that this incarnation is alive when another
        # process registers under our id (docs/operations.md, Across hosts).
        await server.announce_incarnation(incarnation_id)
        print(f"kvrelay dit listening on {server.address}", flush=True)
        endpoint = f"{stage.advertise_host}:{server.bound_port}"

        preset = model_preset(stage.model)
        geometry = dit_geometry(preset, stage.page_size, stage.model.dtype)
        world = stage.world_size
        # The pid in the names tells an operator (and tests) whose pools a /dev/shm file holds.
        tag = f"{replica_id}-{os.getpid()}"
        try:
            memory = ReplicaMemory(
                geometry, stage.head_shards, stage.kv_cache_memory_bytes, tag=tag, cfg_parallel=stage.cfg_parallel_size
            )
        except OSError as err:
            if err.errno not in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise
            # The same on every restart: a deployment error (exit 2), named by its key, not a traceback.
            raise PageMemoryUnavailable(
                f"stages[1].kv_cache_memory_bytes: cannot map {stage.kv_cache_memory_bytes} bytes of page memory "
                f"per rank ({err.strerror}): lower it, or give the host (a container: shm_size) more memory"
            ) from None
        control_pool = HostPool.create(0, control_bytes(admission_slots(stage.max_num_seqs)), f"{tag}-control")
        metrics.pages.labels(replica_id).set(memory.num_pages)
        spec = DitRankSpec.for_stage(
            stage, preset=preset.name, checkpoint=model_dir(stage.model), num_pages=memory.num_pages,
            pools=tuple(memory.specs()), control=control_pool.spec, slots=admission_slots(stage.max_num_seqs),
        )
        # A rank stopped under rank_stall_seconds mid-collective must not time its peers out.
        group = WorkerGroup(world, spec, devices=stage.devices_for(replica), lock=lock, name=f"kvrelay-{replica_id}",
                            dist_timeout_s=collective_timeout_s(cfg.rank_stall_seconds_for(stage)))
        # A fast stop kills the ranks at once: a denoise or load in flight ends, and no rank reads
        # or receives into the pages afterwards (the handlers release their tickets only then).
        stop.on_fast(_killer(group, killing, f"kvrelay-{replica_id}-fast-stop"))
        # A stop during the model load kills the ranks (nothing of theirs is registered with the
        # broker yet): the load cannot be interrupted otherwise, and may take minutes.
        stop.phase = "loading the model"
        await stop.until_stopped(asyncio.to_thread(group.start), abort=group.kill)
        described = await stop.until_stopped(asyncio.to_thread(group.call_all, DescribeRegion(), 120.0), abort=group.kill)
        if stage.transport == "grpc":
            # The fallback's regions are this service's: senders address them by offset through
            # PutKv at our advertised address. (Built here rather than with GrpcStreamReceiver,
            # whose register_region mistakes numpy 2's `ndarray.device` string for a torch device.)
            regions = tuple(
                RegionDescriptor(rank=r, transport="grpc", endpoint=endpoint, base_address=0,
                                 length=len(memory.region(r)))
                for r in range(world)
            )
        else:
            regions = tuple(described)
        log.info("page_memory_ready", replica_id=replica_id, num_pages=memory.num_pages, page_bytes=memory.page_bytes,
                 ranks=world, transport=stage.transport, regions=[r.endpoint[:64] for r in regions])

        # The token as the process holds it now: re-read from its file when the broker refuses it
        # (a rotated secret); a swap reaches the server, the registration and the broker channel at once.
        token = ReplicaToken(replica_id, creds, replica_token_source(replica_token_file_for(cfg.security, replica_id),
                                                            cfg.security.replica_token_env))  # fmt: skip
        channel = broker_channel(broker_address, creds.channel(CallerClass.REPLICA, replica_id), certificates,
                                 live_metadata=token.broker_metadata)  # fmt: skip
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        state = DitReplicaState(
            replica_id=replica_id, incarnation_id=incarnation_id, stage=stage, geometry=geometry, memory=memory,
            control=control_view(control_pool.buffer, admission_slots(stage.max_num_seqs)), group=group, broker=stub,
            metrics=metrics, fail_stop=stopper.fail_stop, regions=tuple(regions),
        )
        servicer.attach(state)
        info = DitReplicaInfo(
            replica_id=replica_id, incarnation_id=incarnation_id, endpoint=endpoint, stage_id=stage.stage_id,
            geometry=geometry, tensor_parallel_size=stage.tensor_parallel_size,
            sequence_parallel_size=stage.sequence_parallel_size, cfg_parallel_size=stage.cfg_parallel_size,
            num_pages=memory.num_pages, max_image_side=model_max_image_side(stage.model),
            max_num_seqs=stage.max_num_seqs, transport=stage.transport, regions=regions,
        )
        async def on_credential_refused(refused: bool) -> None:
            # Not ready while the broker refuses our token (a readiness probe and `kvrelay health`
            # see it); ready again once it takes it, unless stopping meanwhile.
            metrics.credential_refused.set(1 if refused else 0)
            if refused or (stop.phase == "serving" and stopper.fail_reason is None and not stop.requested):
                await server.set_serving(not refused)

        def receiver_run(group: WorkerGroup = group) -> tuple[float, int]:
            ranks = group.stall_free_s()
            return min([process_run.seconds(), *ranks]), len(ranks)

        registration = Registration(
            stub, info, interval_s=cfg.broker.heartbeat_interval, token=creds.replica_token,
            on_fenced=stopper.fail_stop, held_tickets=servicer.held_tickets,
            owed_releases=servicer.owed_releases, highest_sequence=lambda: servicer.fence.highest_sequence,
            credential=BrokerCredentialWatch(replica_id, on_change=on_credential_refused, token=token),
            receiver_run=receiver_run,
        )

        def on_token_swap(new: Credentials, registration: Registration = registration) -> None:
            server.replace_credentials(new)
            registration.token = new.replica_token or ""

        token.on_swap = on_token_swap
        stop.phase = f"registering with the broker at {broker_address}"
        await stop.until_stopped(registration.register(
            broker=broker_address, wait_s=cfg.broker.register_wait_seconds, in_use_wait_s=2 * cfg.broker.lease_seconds
        ))
        registration.start_heartbeats()
        # A missing or stopped rank is a broken invariant even between requests (its pool can no
        # longer be verified or read, its Mooncake engine neither receives nor drains) and in the
        # middle of one (a denoise waits for it up to an hour): the watchdog kills the ranks and
        # fail-stops the replica, whose new incarnation then proves them gone.
        watchdog = asyncio.get_running_loop().create_task(
            watch_ranks(group, stopper.fail_stop, interval_s=cfg.rank_watch_interval,
                        max_silence_s=cfg.rank_stall_seconds_for(stage)),
            name="dit-rank-watchdog",
        )
        if stopper.fail_reason is None and not stop.requested:
            stop.phase = "serving"
            await server.set_serving(not registration.credential.refused)
            log.info("dit_serving", replica_id=replica_id, incarnation_id=incarnation_id, address=server.address)
        stopped = asyncio.ensure_future(stop.event.wait())
        fail_stopped = asyncio.ensure_future(stopper.event.wait())
        await asyncio.wait({stopped, fail_stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        fail_stopped.cancel()
        stop.phase = "draining"
    except StopRequested:
        pass  # stopped before serving: a clean stop of what started, below
    except (PortInUse, PageMemoryUnavailable) as err:
        print(f"kvrelay dit: {err}", file=sys.stderr)
        config_error = True
        stopper.fail_stop(str(err))
    except ReplicaIdInUse as err:
        # Another process of this id serves (another host, another lock folder): starting this one
        # again would be refused the same way, and must never take the id from it. Exit 2.
        log.error("registration_refused", reason="REPLICA_ID_IN_USE", message=str(err))
        print(f"kvrelay dit: the broker refused registration: ALREADY_EXISTS REPLICA_ID_IN_USE: {err}",
              file=sys.stderr)  # fmt: skip
        config_error = True
        stopper.fail_stop(f"startup failed: {err}")
    except BrokerUnreachable as err:
        # One line without a traceback: nothing is broken here, the broker is not where we looked.
        log.error("broker_unreachable", broker=broker_address, code=err.code, message=err.message)
        line = broker_unreachable_line(broker_address, err.waited_s, err.code, err.message)
        print(f"kvrelay dit: {line}", file=sys.stderr)
        stopper.fail_stop(f"startup failed: {err}")
    except Exception as err:  # noqa: BLE001 - startup failure: stop what started, exit non-zero
        log.exception("dit_failed", error=str(err))
        # One line for `kvrelay up` and the terminal (the AR prints its own alike); the log has the rest.
        first = (str(err) or type(err).__name__).splitlines()[0]
        print(f"kvrelay dit: {first if first.startswith('startup failed') else f'startup failed: {first}'}",
              file=sys.stderr)  # fmt: skip
        stopper.fail_stop(f"startup failed: {err}")
    finally:
        process_beat.cancel()
        if watchdog is not None:
            watchdog.cancel()
        failed = stopper.fail_reason is not None
        with contextlib.suppress(Exception):
            await server.set_serving(False)
        if registration is not None:
            # Heartbeats stop in any case; deregistering is a clean stop's, and a fast stop cuts it.
            if failed or stop.fast_requested or not await stop.unless_fast(registration.stop(deregister=True)):
                await registration.stop(deregister=False)
        # In-flight Denoise calls finish (clean stop) or are cut (fail or fast stop) before workers go.
        await server.stop(grace=0.5 if failed else 5.0, fast=stop)
        if servicer.inflight:
            # Cancelled handlers release their tickets (with the broker channel still open); after
            # a fast stop's kill their ranks are gone, so they end at once.
            waiting = asyncio.wait(set(servicer.inflight), timeout=10.0)
            if not await stop.unless_fast(waiting):
                await asyncio.wait(set(servicer.inflight), timeout=1.0)
        # Releases the broker has not heard yet get a last chance while the channel is open; the
        # next incarnation's registration frees what is left.
        if not await stop.unless_fast(servicer.releases.stop(grace_s=1.0 if failed else 5.0)):
            await servicer.releases.stop(grace_s=0.0)
        servicer.attach(None)
        if group is not None:
            # Workers first: their transport registrations of the pools end with them. A fast
            # stop's kill (requested before or during this) ends it at once.
            await asyncio.to_thread(group.stop)
            if killing:
                await killing[0]
        if memory is not None:
            memory.close()
        if control_pool is not None:
            control_pool.close()
        if channel is not None:
            await channel.close()
        lock.release()
        log.info("dit_stopped", replica_id=replica_id, fail_stop=failed, reason=stopper.fail_reason,
                 fast=stop.fast_requested)
    if config_error:
        return 2
    if stop.fast_requested:
        return EXIT_FAST_STOP
    return EXIT_FAIL_STOP if stopper.fail_reason is not None else 0


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, process=f"dit-{args.replica}")
    capture_native_output(f"dit-{args.replica}")
    try:
        cfg = load_config(args.config)
        if getattr(args, "advertise_host", None) is not None:
            cfg = cfg.with_advertise_host("dit", args.advertise_host)
    except ConfigError as err:
        print(f"kvrelay dit: {err}", file=sys.stderr)
        return 2
    from kvrelay.ports import unresolvable_host

    # Before the ranks start: a name that does not resolve here (a compose config outside compose)
    # failed later as `DescribeRegion failed on rank(s) [0]: gaierror: ...`, exit 3, naming nothing.
    where = "--advertise-host" if getattr(args, "advertise_host", None) is not None else "stages[1].advertise_host"
    problem = unresolvable_host(cfg.dit_stage.advertise_host, where)
    if problem is not None:
        print(f"kvrelay dit: {problem}", file=sys.stderr)
        return 2
    from kvrelay.worker import LockTimeout

    try:
        code = asyncio.run(serve(cfg, args))
    except LockTimeout as err:
        print(f"kvrelay dit: {err}", file=sys.stderr)
        exit_without_teardown(2)  # as the AR's (kvrelay.broker.main.run says why)
    if code == EXIT_FAST_STOP:
        # Everything that keeps the contract is done: no interpreter teardown to wait on.
        sys.stdout.flush()
        flush_native_output()
        os._exit(code)
    # Everything is stopped and logged: no interpreter teardown to wait for (seconds, with torch).
    exit_without_teardown(code)
