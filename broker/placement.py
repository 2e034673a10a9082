"""Placement: which AR and which DiT replica serve one generation, and whether any ever can.

Owns the choice of replicas for a queued generation (the up, unfenced, reachable AR with the
fewest live tickets; the up, unfenced, reachable DiT with the most free pages that fits every
row now; a pair whose last transfer failed, or whose transfer failed this very generation, only
when no other pair can take it), the check that a request can ever fit a DiT replica (`NEVER_FITS`), and turning that
choice into a ticket (`BrokerCore.create_ticket`, which reserves the pages and plans the transfer once).
Reads replicas, pools and tickets only through BrokerCore; never reserves a page itself, never
orders the queue (FIFO is the queue's rule, admission.py) and never talks to a replica.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import grpc

from kvrelay.broker.core import BrokerCore
from kvrelay.broker.generations import ErrorInfo, RequestEnded
from kvrelay.broker.registry import ReplicaRole, ReplicaSpec
from kvrelay.broker.tickets import BrokerError, ReplicaId, Ticket, TicketId
from kvrelay.errors import KvRelayServerError, invalid_argument
from kvrelay.transfer.planner import cfg_group


def ar_candidates(core: BrokerCore, exclude: Collection[ReplicaId] = ()) -> list[ReplicaId]:
    """The up, unfenced, reachable AR replicas (but those in `exclude`), fewest live tickets first."""
    load = core.live_tickets_per_ar()
    return [
        rid
        for _, rid in sorted(
            (load.get(s.spec.replica_id, 0), s.spec.replica_id)
            for s in core.list_replicas(ReplicaRole.AR)
            if s.up and not s.fenced and s.reachable and s.spec.replica_id not in exclude
        )
    ]


def serving_replicas(core: BrokerCore, role: ReplicaRole, exclude: Collection[ReplicaId] = ()) -> list[ReplicaId]:
    """The up, unfenced, reachable replicas of `role` but those in `exclude`, whether or not they
    have room now: whom a generation retried away from `exclude` could still be placed on."""
    return [
        s.spec.replica_id
        for s in core.list_replicas(role)
        if s.up and not s.fenced and s.reachable and s.spec.replica_id not in exclude
    ]


def choose_ar_replica(core: BrokerCore) -> ReplicaId | None:
    """The up, unfenced, reachable AR replica with the fewest live tickets."""
    candidates = ar_candidates(core)
    return candidates[0] if candidates else None


def takes_image(spec: ReplicaSpec, side: int) -> bool:
    """Whether a DiT replica's model generates images `side` pixels wide or high."""
    return not spec.max_image_side or side <= spec.max_image_side


def dit_candidates(
    core: BrokerCore, row_token_counts: Sequence[int], image_side: int = 0, exclude: Collection[ReplicaId] = ()
) -> list[ReplicaId]:
    """The up, unfenced, reachable DiT replicas (but those in `exclude`) that fit the rows now (and
    whose model generates an image `image_side` pixels wide or high), most free pages first."""
    keyed = []
    for status in core.list_replicas(ReplicaRole.DIT):
        rid = status.spec.replica_id
        if rid in exclude:
            continue
        if not status.up or status.fenced or not status.reachable or not takes_image(status.spec, image_side):
            continue
        if not core.fits_now(rid, row_token_counts):
            continue
        keyed.append((-core.free_pages(rid), rid))
    return [rid for _, rid in sorted(keyed)]


def choose_dit_replica(core: BrokerCore, row_token_counts: Sequence[int], image_side: int = 0) -> ReplicaId | None:
    """The up, unfenced, reachable DiT replica with the most free pages that fits the rows now
    (and whose model generates an image `image_side` pixels wide or high)."""
    candidates = dit_candidates(core, row_token_counts, image_side)
    return candidates[0] if candidates else None


Pair = tuple[ReplicaId, ReplicaId]  # (AR replica id, DiT replica id)


def choose_pair(
    core: BrokerCore,
    row_token_counts: Sequence[int],
    image_side: int = 0,
    exclude: Collection[ReplicaId] = (),
    *,
    avoid_pairs: Collection[Pair] = (),
    exclude_pairs: Collection[Pair] = (),
) -> tuple[ReplicaId | None, ReplicaId | None]:
    """The AR and DiT for one generation: the least-loaded AR and the DiT with the most free pages,
    skipping pairs whose last transfer failed within its backoff (`BrokerCore.link_suspect`)
    while another pair can take the request; when every pair is suspect, the plain choice.
    Never a replica in `exclude` (those that failed this generation's earlier attempts), never a
    pair in `exclude_pairs`; a pair in `avoid_pairs` (whose transfer failed this generation) only
    when no other pair can take it now, suspect or not."""
    ars = ar_candidates(core, exclude)
    dits = dit_candidates(core, row_token_counts, image_side, exclude)
    pairs = [(ar_id, dit_id) for ar_id in ars for dit_id in dits if (ar_id, dit_id) not in exclude_pairs]
    if not pairs:
        # What is missing, as before: no AR, or no DiT that fits now (or every pair is excluded).
        return (ars[0] if ars else None), (dits[0] if dits and not ars else None)
    fresh = [pair for pair in pairs if pair not in avoid_pairs]
    for ar_id, dit_id in fresh:
        if not core.link_suspect(ar_id, dit_id):
            return ar_id, dit_id
    return fresh[0] if fresh else pairs[0]


def check_image_fits(core: BrokerCore, width: int, height: int) -> None:
    """Raise INVALID_ARGUMENT (IMAGE_TOO_LARGE, naming `width` or `height`) unless some up DiT
    replica's model generates an image this large (BAGEL's position table covers 1024 pixels)."""
    dits = [s for s in core.list_replicas(ReplicaRole.DIT) if s.up and not s.fenced]
    side = max(width, height)
    if not dits or any(takes_image(s.spec, side) for s in dits):
        return  # no DiT at all is check_ever_fits' NO_DIT_REPLICA
    largest = max(s.spec.max_image_side for s in dits)
    too_large = invalid_argument(
        "width" if width > largest else "height",
        f"{width}x{height}: the DiT model generates at most {largest} pixels per side",
    )
    too_large.reason = "IMAGE_TOO_LARGE"
    raise too_large


def check_ever_fits(core: BrokerCore, counts: Sequence[int]) -> None:
    """Raise UNAVAILABLE (NO_DIT_REPLICA) or INVALID_ARGUMENT (NEVER_FITS) unless some up DiT
    replica's whole pool could hold these rows."""
    dits = [s for s in core.list_replicas(ReplicaRole.DIT) if s.up and not s.fenced]
    if not dits:
        raise KvRelayServerError(grpc.StatusCode.UNAVAILABLE, "NO_DIT_REPLICA", "no DiT replica is up")
    if any(core.ever_fits(s.spec.replica_id, counts) for s in dits):
        return
    # For the message: a CFG-parallel replica holds each row in its group's pool, so its need
    # is the largest group's, not the sum.
    needed = {
        s.spec.replica_id: max(
            sum(n for row, n in enumerate(core.pages_needed(s.spec.replica_id, counts))
                if cfg_group(row, s.spec.cfg_parallel_size) == g)
            for g in range(s.spec.cfg_parallel_size)
        )
        for s in dits
    }
    largest = max(s.spec.num_pages for s in dits)
    never = invalid_argument(
        "prompt",
        f"the prompt rows need {min(needed.values())} KV pages; the largest DiT replica has {largest}: "
        "this request can never fit (shorten the prompt or the negative prompt)",
    )
    never.reason = "NEVER_FITS"
    raise never


def place(
    core: BrokerCore,
    request_id: str,
    token_counts: Sequence[int],
    width: int = 0,
    height: int = 0,
    *,
    exclude: Collection[ReplicaId] = (),
    avoid_pairs: Collection[Pair] = (),
    exclude_pairs: Collection[Pair] = (),
    replaces: TicketId = "",
) -> Ticket | None:
    """A RESERVED ticket for this generation on the chosen replicas, or None: not now.

    `exclude`, `avoid_pairs`, `exclude_pairs` and `replaces` place a retried generation: never on
    a replica that failed it nor on a pair excluded, on a pair whose transfer failed it only when
    no other pair can take it (`choose_pair`), and beside its earlier attempt's ticket
    (`replaces`), which ended and may still drain.
    Raises RequestEnded when it can never run (no DiT could ever hold it, or the chosen
    replicas refuse it for good).
    """
    existing = core.ticket_for_request(request_id)
    beside = ""
    if existing is not None and not existing.by_hand and existing.ticket_id != replaces:
        # An earlier generation with this id (ended and forgotten after result_ttl_seconds or
        # max_results, or lost with a broker restart) still holds its ticket: draining while a
        # write of it may land, which can last until its AR's next incarnation. This one gets
        # pages of its own beside it, as a retry beside its earlier attempt, rather than wait for
        # it at the queue's head, holding every generation behind it. (Its own earlier attempt's
        # ticket is `replaces`; a generation runs one attempt at a time, so any other ticket of a
        # generation under this id is an earlier generation's. A ticket made by hand under this
        # id: the core places this one beside it once its request is over, and refuses while it
        # is live, REQUEST_ID_REUSED, which Generate's admission already refused.)
        beside = existing.ticket_id
    ar_id, dit_id = choose_pair(
        core, token_counts, max(width, height), exclude, avoid_pairs=avoid_pairs, exclude_pairs=exclude_pairs
    )
    if dit_id is None:
        try:
            # The DiT replicas may have changed since admission (one restarted smaller): a
            # head that can no longer fit any of them would block the whole queue.
            check_ever_fits(core, token_counts)
            check_image_fits(core, width, height)
        except KvRelayServerError as err:
            if err.code is grpc.StatusCode.INVALID_ARGUMENT:
                raise RequestEnded(ErrorInfo(err.code.name, err.reason, err.message)) from None
    if ar_id is None or dit_id is None:
        return None
    try:
        return core.create_ticket(request_id, ar_id, dit_id, token_counts, replaces=replaces, beside=beside)
    except BrokerError as err:
        if err.code == "UNAVAILABLE":
            return None  # the replica went down between choice and reservation: next round
        # Can never run on the chosen replicas (e.g. an AR with a smaller max_tokens).
        raise RequestEnded(ErrorInfo(err.code, err.reason, err.message)) from None
