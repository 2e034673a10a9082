"""Is a port free, and if not, who holds it: checked before anything starts.

A node whose ports are taken must say so in one line before it starts a single process (a second
`kvrelay up` next to a running one would otherwise find the first node's health answering on
"its" ports). Pure stdlib + psutil; no grpc, no torch.
"""

from __future__ import annotations

import errno
import os
import random
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil


class PortInUse(OSError):
    """A port the node must listen on is taken; the message names the port and its holder."""


@dataclass(frozen=True, slots=True)
class Listen:
    """One port a process of the node will bind: `what` says whose it is ("broker gRPC")."""

    host: str
    port: int
    what: str
    # The setting that chose the port ("broker.port"), named by the error when it is taken.
    setting: str = ""


def port_holder(port: int) -> str:
    """Who listens on `port` on this host, as far as this user may see."""
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        connections = []
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return "a process of another user"
            try:
                proc = psutil.Process(conn.pid)
                # One line, whatever the holder's arguments hold (`python -c` with newlines).
                cmdline = " ".join(" ".join(proc.cmdline()).split()) or proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return f"pid {conn.pid}"
            if len(cmdline) > 100:
                cmdline = cmdline[:97] + "..."
            return f"pid {conn.pid} ({cmdline})"
    return "another process"


def _bind_host(host: str) -> str:
    return "0.0.0.0" if host in ("", "*") else host.strip("[]")


def is_port_free(host: str, port: int) -> bool:
    """Whether a listener could bind `host:port` now (SO_REUSEADDR, as gRPC and Prometheus bind)."""
    bare = _bind_host(host)
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bare, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def in_use_message(port: int, what: str, host: str = "") -> str:
    return f"port {port} ({what}, on {host or '0.0.0.0'}) is already in use by {port_holder(port)}"


def check_ports_free(listens: Iterable[Listen]) -> None:
    """Raise PortInUse naming the first taken port, its owner in the node and who holds it."""
    seen: dict[int, str] = {}
    for listen in listens:
        if listen.port == 0:
            continue
        if listen.port in seen:
            raise PortInUse(f"port {listen.port} is configured twice: {seen[listen.port]} and {listen.what}")
        seen[listen.port] = listen.what
        try:
            free = is_port_free(listen.host, listen.port)
        except OSError as err:
            raise PortInUse(f"port {listen.port} ({listen.what}) cannot be bound: {err.strerror}") from None
        if not free:
            message = in_use_message(listen.port, listen.what, listen.host)
            if listen.setting:
                # What to do: a second `kvrelay up` beside a running node said whose the port was, not
                # how to get past it (found walking the README as a new user).
                message += f": stop it, or set another {listen.setting} in the config (0 = any free port)"
            raise PortInUse(message)


def unresolvable_host(host: str, what: str) -> str | None:
    """Why `host` (an advertise_host: what peers dial, and the Mooncake session this process
    publishes) cannot be used on this host, or None. Only a definite "no such name" counts: a
    temporary resolver failure is left to the start-up it would delay."""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        if err.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return None
        return (
            f"{what} {host!r} does not resolve on this host ({err.strerror}): set it (or --advertise-host) to an "
            "address of this host that the broker and the other replicas can reach"
        )
    return None


# A port picked for `port: 0` is kept across the child's restarts (same address). One from the
# kernel's ephemeral range, which bind(0) hands out, may meanwhile become the local port of any
# outgoing connection on the host, and the restarted child then cannot bind it: a broker restarted
# after a journal failure exited twice with "port 58323 (broker metrics) is already in use" and
# stayed down for a minute of backoff. So such ports are picked outside that range.
_PICKED_PORT_FLOOR = 20000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if unknown)."""
    try:
        low, high = (int(part) for part in Path(_EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


# Every port this process handed out, so two picks never return the same one (a bench node once
# got one port for its AR's gRPC and metrics: bind(0) twice in a row may return the same port).
_HANDED_OUT: set[int] = set()


def mooncake_port_range() -> tuple[int, int]:
    """Where Mooncake engines of this process and its children draw their RPC and data ports
    (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, Mooncake's default 15000-17000)."""
    try:
        return int(os.environ.get("MC_MIN_RPC_PORT", 15000)), int(os.environ.get("MC_MAX_RPC_PORT", 17000))
    except ValueError:
        return 15000, 17000


def pick_free_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A port free a moment ago on `host`, outside the kernel's ephemeral range and Mooncake's
    port range where there is room (either may take it meanwhile), and never one this process
    handed out before (nor one in `taken`, which gets it)."""
    taken = _HANDED_OUT if taken is None else taken
    bare = host.strip("[]")
    low, high = ephemeral_port_range()
    mc_low, mc_high = mooncake_port_range()
    spans = [(lo, hi) for lo, hi in ((_PICKED_PORT_FLOOR, low - 1), (high + 1, 65535)) if hi - lo >= 1000]
    for _ in range(200 if spans else 0):
        lo, hi = random.choice(spans)
        port = random.randint(lo, hi)
        if mc_low <= port <= mc_high or port in taken or port in _HANDED_OUT:
            continue
        if is_port_free(bare, port):
            taken.add(port)
            _HANDED_OUT.add(port)
            return port
    # No room outside the ephemeral range (or all of it taken): let the kernel choose.
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    for _ in range(100):
        with socket.socket(family) as sock:
            sock.bind((bare, 0))
            port = int(sock.getsockname()[1])
        if port not in taken and port not in _HANDED_OUT:
            taken.add(port)
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host}")
