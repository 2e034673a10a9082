"""`kvrelay generate`, `status`, `list`, `cancel` and `forget`: thin command-line front ends over the SDK.

Owns presentation only (progress on stderr, tables and paths on stdout, exit codes). Talks to the
broker only through `KvRelayClient`; never imports torch, the config or a service package, so a
client-only install runs it.

Exit codes: 0 success, 1 an error from kvrelay (code, reason and message are printed),
130 interrupted (Ctrl-C cancels the generation on the server first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import enum
import json
import math
import os
import shutil
import signal
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from kvrelay.limits import (
    MAX_LIST_PAGE_SIZE,
    MAX_PEM_FILE_BYTES,
    MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_LENGTH,
    QUOTED_ID_CHARS,
    FileRefused,
    read_bounded_file,
)
from kvrelay.suggest import did_you_mean

from ._common import CANCEL_TIMEOUT, DEFAULT_TARGET
from .errors import KvRelayError
from .sync import GenerationHandle, KvRelayClient
from .types import (
    CredentialRefusal,
    ForgottenIncarnation,
    Generation,
    GenerationEvent,
    GenerationState,
    PhaseTimings,
    PoolStatus,
    Replica,
    ReplicaRole,
    Ticket,
    WriteStatus,
)

TOKEN_ENV = "KVRELAY_API_TOKEN"
OPERATOR_TOKEN_ENV = "KVRELAY_OPERATOR_TOKEN"
TLS_ENV = {"tls_ca": "KVRELAY_TLS_CA", "tls_cert": "KVRELAY_TLS_CERT", "tls_key": "KVRELAY_TLS_KEY"}
_PHASES = ("queue", "prefill", "transfer", "load", "denoise", "decode")
# The deadline of each call of status, list, cancel and forget (seconds).
UNARY_TIMEOUT_S = 10.0
# How long `kvrelay list` waits in all for pages the broker refused RATE_LIMITED (_list_pages).
LIST_RATE_WAIT_S = 60.0


def _token(args: argparse.Namespace, *envs: str) -> str | None:
    if getattr(args, "token", None):
        return str(args.token)
    for env in envs or (TOKEN_ENV,):
        if os.environ.get(env):
            return os.environ[env]
    return None


def _target(args: argparse.Namespace) -> str:
    return str(getattr(args, "target", None) or DEFAULT_TARGET)


def tls_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --tls-ca/--tls-cert/--tls-key (or $KVRELAY_TLS_*) before any call, or
    None: a certificate without its key (or a key alone) was the SDK's ValueError traceback, and a
    file that is not PEM failed only at the handshake, with a hint about the broker's TLS."""
    given: dict[str, tuple[str | None, str]] = {
        key: (getattr(args, key, None), f"--{key.replace('_', '-')}") for key in TLS_ENV
    }
    for name, env in TLS_ENV.items():
        if not given[name][0] and os.environ.get(env):
            given[name] = (os.environ[env], f"${env}")
    (cert, cert_flag), (key, key_flag) = given["tls_cert"], given["tls_key"]
    if bool(cert) != bool(key):
        have, lack = (cert_flag, "--tls-key") if cert else (key_flag, "--tls-cert")
        return f"{have} needs {lack} too: a client certificate and its private key go together (mutual TLS)"
    for path, flag in given.values():
        if not path:
            continue
        try:
            # Bounded, regular files only: /dev/zero was read until MemoryError; a pipe would be
            # read empty by the client next.
            pem = read_bounded_file(path, MAX_PEM_FILE_BYTES, "PEM file")
        except FileRefused as err:
            return f"{flag} {path}: {err}"
        except OSError as err:
            return f"{flag} {path}: {err.strerror or err}"
        if b"-----BEGIN " not in pem:
            return f"{flag} {path}: not a PEM file (no -----BEGIN line)"
    if cert and key:
        return _pair_problem(cert, cert_flag, key, key_flag)
    return None


def _pair_problem(cert: str, cert_flag: str, key: str, key_flag: str) -> str | None:
    """Why the client certificate and key are no pair gRPC can present, or None. Found black-box:
    a key that was not the certificate's (or no key at all in the PEM) printed gRPC's C-core log
    lines and then `UNAVAILABLE: empty address list`, with a hint about the broker's TLS."""
    try:
        cert_pem = read_bounded_file(cert, MAX_PEM_FILE_BYTES, "PEM file")
        key_pem = read_bounded_file(key, MAX_PEM_FILE_BYTES, "PEM file")
    except (FileRefused, OSError) as err:
        return f"{cert_flag} {cert} / {key_flag} {key}: {err}"
    if b"CERTIFICATE-----" not in cert_pem:
        return f"{cert_flag} {cert}: holds no certificate (-----BEGIN CERTIFICATE-----)"
    if b"PRIVATE KEY-----" not in key_pem:
        return f"{key_flag} {key}: holds no private key (-----BEGIN PRIVATE KEY-----)"
    if b"ENCRYPTED" in key_pem:
        return f"{key_flag} {key}: the key is encrypted; the client needs it unencrypted"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        # The callback answers an encrypted key the check above missed: OpenSSL would prompt.
        context.load_cert_chain(cert, key, password=lambda: b"\0")
    except ssl.SSLError as err:
        if "KEY_VALUES_MISMATCH" in str(err):
            return f"{key_flag} {key} is not the private key of {cert_flag} {cert}"
        return f"{cert_flag} {cert} and {key_flag} {key}: not a certificate and its private key ({err.reason or err})"
    except OSError as err:
        return f"{cert_flag} {cert} / {key_flag} {key}: {err.strerror or err}"
    return None


def _tls(args: argparse.Namespace) -> dict[str, Any]:
    """KvRelayClient TLS keyword arguments from --tls-ca/--tls-cert/--tls-key or $KVRELAY_TLS_*."""
    files = {key: getattr(args, key, None) or os.environ.get(env) for key, env in TLS_ENV.items()}
    kwargs: dict[str, Any] = {}
    for key, arg in (("tls_ca", "root_certificates"), ("tls_cert", "certificate_chain"), ("tls_key", "private_key")):
        path = files[key]
        if path:
            kwargs[arg] = read_bounded_file(path, MAX_PEM_FILE_BYTES, "PEM file")
    if kwargs:
        kwargs["tls"] = True
    return kwargs


def _shown_id(request_id: str) -> str:
    """A request id as human output shows it: whole up to the broker's bound (what any real id
    fits), else its first characters, an ellipsis and its length: a 5,000-character id typed by
    mistake was echoed whole in every error. Terminal controls escaped. --json output is exact."""
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        request_id = f"{request_id[:QUOTED_ID_CHARS]}... ({len(request_id)} characters)"
    return _printable(request_id)


# The credential each command sends, and where it reads it from without --token.
_API = ("the deployment's api token", f"${TOKEN_ENV}")
_OPERATOR = ("the operator token", f"${OPERATOR_TOKEN_ENV} (else ${TOKEN_ENV})")
# `_sent_token`'s prefix when the credential sent is a client certificate (no token).
_CERT_SENT = "certificate:"
_CREDENTIAL = {"generate": _API, "cancel": _API, "status": _OPERATOR, "list": _OPERATOR, "forget": _OPERATOR,
               "rotate-secrets": _OPERATOR}

# GenerateRequest fields whose `kvrelay generate` flag has another name (an INVALID_ARGUMENT names
# the field; width, height and seed are their flags' names, prompt the argument).
_GENERATE_FLAGS = {
    "num_inference_steps": "--steps",
    "guidance_scale": "--guidance-scale",
    "negative_prompt": "--negative-prompt",
    "request_id": "--request-id",
}


def _sent_token(command: str, args: argparse.Namespace) -> str:
    """Where the token this command sent came from ("--token", "$KVRELAY_API_TOKEN"), or ""."""
    if getattr(args, "token", None):
        return "--token"
    envs = (OPERATOR_TOKEN_ENV, TOKEN_ENV) if _CREDENTIAL.get(command) is _OPERATOR else (TOKEN_ENV,)
    token = next((f"${env}" for env in envs if os.environ.get(env)), "")
    if not token and _CREDENTIAL.get(command) is _OPERATOR:
        # No token: a client certificate is the credential (mutual TLS, tls.operator_names).
        if getattr(args, "tls_cert", None):
            return f"{_CERT_SENT}--tls-cert {args.tls_cert}"
        if os.environ.get(TLS_ENV["tls_cert"]):
            return f"{_CERT_SENT}${TLS_ENV['tls_cert']} ({os.environ[TLS_ENV['tls_cert']]})"
    return token


def _print_error(
    command: str,
    err: KvRelayError,
    stream: TextIO,
    tls: bool | None = None,
    target: str | None = None,
    sent: str | None = None,
) -> None:
    reason = f" ({err.reason})" if err.reason and err.reason != err.code else ""
    # The message and details are the server's words, and a replica's it relays: terminal
    # controls in them are escaped as in the tables (a DiT's failure message with ESC ] 0 ; ... BEL
    # would retitle the user's terminal; found red-teaming the CLI).
    print(f"kvrelay {command}: {err.code}{_printable(reason)}: {_printable(err.message)}", file=stream)
    for key, value in sorted(err.details.items()):
        if key == "request_id" and value == err.request_id:
            continue  # printed below (REQUEST_ID_REUSED carried it twice)
        print(f"  {_printable(key)}: {_shown_id(value) if key == 'request_id' else _printable(value)}", file=stream)
    if err.request_id:
        print(f"  request_id: {_shown_id(err.request_id)}", file=stream)
    flag = _GENERATE_FLAGS.get(err.details.get("field", "")) if command == "generate" else None
    if err.code == "INVALID_ARGUMENT" and flag is not None:
        # The field is the API's name: `num_inference_steps: must be in [1, 1000], got 0` did not
        # say that the flag to fix is --steps (found walking the README as a new user).
        print(f"  hint: {err.details['field']} is {flag} here", file=stream)
    if err.code in ("UNAUTHENTICATED", "PERMISSION_DENIED") and command in _CREDENTIAL and sent is not None:
        # The broker's message names the RPC and "authorization: Bearer <token>", not this
        # command's flag or variable, nor which of the deployment's tokens it wants.
        which, variables = _CREDENTIAL[command]
        if sent.startswith(_CERT_SENT):
            # Found black-box against a mutual-TLS node: a client (not operator) certificate got
            # "needs the operator token: pass --token", which names neither the certificate nor
            # what would make it an operator's.
            print(f"  hint: the client certificate sent ({sent[len(_CERT_SENT):]}) is not an operator's: its "
                  "common name must be in the node's security.tls.operator_names (default kvrelay-operator); "
                  f"or pass --token TOKEN or set {variables} (docs/operations.md, Security)", file=stream)  # fmt: skip
        else:
            what = f"the token sent ({sent}) is not {which}" if sent else f"kvrelay {command} needs {which}"
            print(f"  hint: {what}: pass --token TOKEN or set {variables} (docs/operations.md, Security)",
                  file=stream)  # fmt: skip
    where = target or "the target"
    if err.code == "UNIMPLEMENTED" and tls is not None:
        # An AR or DiT replica (or another gRPC server) answers there, not the broker.
        print(f"  hint: {where} does not serve this kvrelay API (an AR or DiT replica's port?): --target is the "
              "broker's HOST:PORT (kvrelay up prints it; 127.0.0.1:50051 by default)", file=stream)  # fmt: skip
    if err.code == "DEADLINE_EXCEEDED" and err.reason == "DEADLINE_EXCEEDED" and tls is not None and command != "generate":
        # `kvrelay status` against a stopped (SIGSTOP) or wedged broker printed only "DEADLINE_EXCEEDED:
        # Deadline Exceeded" after its 10 s (found black-box). generate has its own --timeout hint.
        print(f"  hint: {where} did not answer within {UNARY_TIMEOUT_S:g} s: is the broker stopped, hung or "
              "overloaded (check it, or kvrelay up's log)?", file=stream)  # fmt: skip
    if err.code == "UNAVAILABLE" and err.reason == "UNAVAILABLE" and tls is not None:
        if "Failed parsing HTTP/2" in err.message:
            # Not gRPC at all: a metrics port (HTTP/1.1) or another service. No TLS setting helps.
            hint = f"{where} does not speak gRPC (a metrics port?): --target is the broker's gRPC HOST:PORT"
        elif "DNS resolution failed" in err.message:
            # The name does not resolve: no TLS setting would help either.
            hint = f"cannot resolve the host of {where}: is --target HOST:PORT right?"
        elif "Connection refused" in err.message:
            # Nothing listens there: no TLS setting would help.
            hint = f"nothing listens at {where}: is the node up (kvrelay up), and is --target right?"
        elif "is not in peer certificate" in err.message:
            # Found black-box (a broker certificate for another name): the generic TLS hint below
            # did not say that the CA was right and the name was not.
            hint = (f"the broker's certificate (from --tls-ca's CA) does not name the host of {where}: --target "
                    "a host its certificate names (subjectAltName), or reissue it for this one")  # fmt: skip
        elif "CERTIFICATE_VERIFY_FAILED" in err.message and tls:
            # The server's certificate does not chain to --tls-ca: another CA's, expired, not yet valid.
            hint = (f"the certificate {where} presents does not verify against --tls-ca: signed by another CA, "
                    "expired or not yet valid? (openssl s_client -connect HOST:PORT shows it)")  # fmt: skip
        elif "before receiving SETTINGS frame" in err.message:
            # The port accepted the connection and said nothing for gRPC's 20 s connect timeout: a
            # stopped (SIGSTOP, a debugger) or wedged broker, or a server that waits for its client
            # to speak first. A TLS/plaintext mismatch fails at once instead ("Socket closed", an
            # SSL error); this was hinted as one (found black-box with the broker stopped).
            hint = (f"{where} accepted the connection but never answered: is the broker stopped or hung "
                    "(check it, or kvrelay up's log), or is --target another service?")  # fmt: skip
        else:
            # The transport never answered: a plaintext client of a TLS node (or the reverse)
            # looks exactly like a node that is down.
            hint = (
                "is the broker serving TLS? pass --tls-ca (and --tls-cert/--tls-key for mutual TLS)"
                if not tls
                else "does the broker serve TLS with a certificate from --tls-ca, and accept --tls-cert?"
            )
        print(f"  hint: {hint}", file=stream)


# ---------------------------------------------------------------------------------------------
# kvrelay generate
# ---------------------------------------------------------------------------------------------


class _Progress:
    """Stages and denoising steps on stderr: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self._stream = stream
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._bar: Any = None
        self._started = time.monotonic()
        self._last: tuple[GenerationState, int, int] | None = None
        self._waiting: tuple[str, str] | None = None

    def update(self, event: GenerationEvent) -> None:
        self._waiting = None
        if not self._enabled or (event.state, event.step, event.attempt) == self._last:
            return
        retried = self._last is not None and event.attempt > self._last[2]
        self._last = (event.state, event.step, event.attempt)
        if self._tty:
            self._update_bar(event)
            return
        elapsed = time.monotonic() - self._started
        text = event.state.name
        if event.state == GenerationState.DENOISING and event.total_steps:
            text += f" {event.step}/{event.total_steps}"
        if retried:
            # The broker runs it again (broker.max_replica_retries): its replica stopped answering,
            # lost a rank or was forgotten by force (then on another replica), or its KV transfer
            # failed (then with a fresh ticket, on another AR/DiT pair if one is up).
            text += f" (its replica or KV transfer failed: attempt {event.attempt})"
        print(f"[{elapsed:7.2f}s] {text}", file=self._stream, flush=True)

    def _update_bar(self, event: GenerationEvent) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(
                total=None,
                file=self._stream,
                unit="step",
                # A terminal that reports no size (some ptys) would get a zero-width bar.
                ncols=min(100, shutil.get_terminal_size((80, 24)).columns or 80),
                bar_format="{desc:<14}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]",
            )
        bar = self._bar
        name = event.state.name.lower()
        bar.set_description_str(name if event.attempt <= 1 else f"{name} #{event.attempt}", refresh=False)
        if event.state == GenerationState.DENOISING and event.total_steps:
            if bar.total != event.total_steps:
                bar.reset(total=event.total_steps)
            bar.n = event.step
        elif event.state == GenerationState.SUCCEEDED and bar.total:
            bar.n = bar.total
        bar.refresh()

    def waiting(self, error: KvRelayError, seconds: float) -> None:
        """The stream ended retryably and is opened again after `seconds`: say why, once per
        reason until an event arrives. Before, a generate sent while the node still started (its
        replicas not registered yet: NO_AR_REPLICA) printed nothing until QUEUED, 8-20 s later."""
        if not self._enabled or (error.code, error.reason) == self._waiting:
            return
        self._waiting = (error.code, error.reason)
        elapsed = time.monotonic() - self._started
        what = f"{error.code} {error.reason}" if error.reason != error.code else error.code
        line = f"[{elapsed:7.2f}s] waiting: {what}: {error.message} (asking again; Ctrl-C cancels)"
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_timings(timings: PhaseTimings) -> str:
    parts = [f"{name} {getattr(timings, f'{name}_seconds'):.3f}s" for name in _PHASES]
    return "  ".join(parts) + f"  | total {timings.total_seconds:.3f}s"


# A prompt is read only this far (characters): one past what the broker ever takes (a file or
# pipe without end, `--prompt-file /dev/zero`, read until MemoryError).
_PROMPT_READ_CHARS = MAX_PROMPT_BYTES + 1


def read_prompt(args: argparse.Namespace, stdin: TextIO | None) -> str:
    """The prompt from the argument, `--prompt-file PATH`, or stdin (`-` as either).

    Raises ValueError saying what is wrong (none given, both given, an unreadable or empty file).
    A file's trailing newlines are dropped; everything else (inner newlines too) is the prompt.
    """
    prompt = getattr(args, "prompt", None)
    prompt_file = getattr(args, "prompt_file", None)
    if prompt is not None and prompt_file is not None:
        raise ValueError("give the prompt as an argument or with --prompt-file, not both")
    source = prompt_file if prompt_file is not None else ("-" if prompt == "-" else None)
    if source is None:
        if not prompt:
            raise ValueError("no prompt: give it as an argument, with --prompt-file PATH, or on stdin with -")
        return str(prompt)
    if source == "-":
        if stdin is None:
            raise ValueError("reading the prompt from stdin, but there is no stdin (it is closed)")
        if stdin.isatty():
            raise ValueError("reading the prompt from stdin, but stdin is a terminal (pipe it in)")
        try:
            text = stdin.read(_PROMPT_READ_CHARS)
        except UnicodeDecodeError as err:
            raise ValueError(
                f"the prompt from stdin: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})"
            ) from None
        where = "stdin"
    else:
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read(_PROMPT_READ_CHARS)
        except OSError as err:
            raise ValueError(f"cannot read --prompt-file {source}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            # Was "'utf-8' codec can't decode byte 0xff in position 2: invalid start byte".
            raise ValueError(
                f"--prompt-file {source}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})"
            ) from None
        where = f"--prompt-file {source}"
    if len(text) >= _PROMPT_READ_CHARS:
        raise ValueError(
            f"the prompt from {where} is longer than {MAX_PROMPT_BYTES} characters: "
            f"the broker takes at most {MAX_PROMPT_BYTES} bytes of UTF-8 (1 MiB)"
        )
    text = text.rstrip("\r\n")
    if not text.strip():
        raise ValueError(f"the prompt from {where} is empty")
    return text


def output_problem(output: str) -> str | None:
    """Why the PNG could not be written to `output`, checked before generating (`None`: it can).
    Creates its parent folders, as writing it would."""
    if os.path.isdir(output):
        return f"-o {output}: is a folder; name the PNG file, e.g. {os.path.join(output, 'out.png')}"
    parent = os.path.dirname(output) or "."
    existing = parent
    while not os.path.lexists(existing) and os.path.dirname(existing) not in ("", existing):
        existing = os.path.dirname(existing)
    if os.path.lexists(existing) and not os.path.isdir(existing):
        return f"-o {output}: {existing} is a file, not a folder"
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        return f"-o {output}: cannot create its folder {parent}: {err.strerror or err}"
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(output) and not os.access(output, os.W_OK)):
        return f"-o {output}: not writable"
    if not os.path.lexists(output):
        # os.access answers yes to root whatever the folder is (/proc, an immutable folder): make
        # the file, as the write will, and remove it again.
        try:
            os.close(os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return None
        except OSError as err:
            return f"-o {output}: not writable: {err.strerror or err}"
        with contextlib.suppress(OSError):
            os.unlink(output)
    return None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def run_generate(args: argparse.Namespace) -> int:
    """`kvrelay generate PROMPT -o out.png`: one image, progress on stderr, Ctrl-C cancels."""
    stdout, stderr = sys.stdout, sys.stderr
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay generate: {problem}", file=stderr)
        return 2
    try:
        prompt = read_prompt(args, sys.stdin)
    except ValueError as err:
        print(f"kvrelay generate: {err}", file=stderr)
        return 2
    quiet = bool(getattr(args, "quiet", False))
    output = getattr(args, "output", None) or "out.png"
    problem = None if output == "-" else output_problem(output)
    if output == "-" and _is_terminal(stdout):
        # PNG bytes on a terminal are garbage on the screen (and may set it in odd modes), as curl
        # and gzip refuse too: checked before the generation runs.
        problem = "-o -: stdout is a terminal; redirect it (-o - > fox.png, -o - | display) or give a file name"
    if problem is not None:
        # Before the generation, not after it: the image of a long run was lost to a typo in -o.
        print(f"kvrelay generate: {problem}", file=stderr)
        return 2
    progress = _Progress(stderr, enabled=not quiet)
    handle: GenerationHandle | None = None
    interrupted, cancelling = threading.Event(), threading.Event()
    watchdog: list[threading.Thread] = []

    def on_interrupt(signum: int, frame: Any) -> None:
        # KeyboardInterrupt, as by default. It can be swallowed (raised inside a finalizer or a
        # library's except-all, where Python only prints it); then, a second later, a thread
        # cancels the generation, which ends the event stream below with CANCELLED.
        if not interrupted.is_set():
            interrupted.set()
            if handle is not None:
                watchdog.append(threading.Thread(target=_cancel_unless, args=(handle, cancelling), daemon=True))
                watchdog[0].start()
        raise KeyboardInterrupt

    def on_cancel() -> int:
        cancelling.set()
        progress.close()
        code = _cancel_on_interrupt(handle, stderr)
        for thread in watchdog:
            thread.join(CANCEL_TIMEOUT)
        return code

    with KvRelayClient(_target(args), token=_token(args), **_tls(args)) as client, _on_sigint(on_interrupt):
        try:
            handle = client.generate(
                prompt,
                negative_prompt=getattr(args, "negative_prompt", "") or "",
                seed=getattr(args, "seed", None),
                width=getattr(args, "width", 512),
                height=getattr(args, "height", 512),
                num_inference_steps=getattr(args, "steps", 2),
                guidance_scale=getattr(args, "guidance_scale", 2.0),
                # Always an id of our own: the stream can then re-attach (a broker or replica being
                # restarted) and Ctrl-C can cancel by id even before the first event.
                request_id=getattr(args, "request_id", None) or uuid.uuid4().hex,
                timeout=getattr(args, "timeout", None),
            )
            handle._on_wait = progress.waiting
            for event in handle.events():
                progress.update(event)
            progress.close()
            if interrupted.is_set():
                return on_cancel()
            result = handle.result()
        except KeyboardInterrupt:
            return on_cancel()
        except KvRelayError as err:
            progress.close()
            _print_error("generate", err, stderr, tls=bool(_tls(args)), target=_target(args), sent=_sent_token("generate", args))
            last = handle.last_event if handle is not None else None
            if err.retryable and last is not None and last.state is GenerationState.FAILED:
                # "the generation can be retried" (the broker's words) did not say that this
                # command's --request-id would attach to the FAILED one again.
                again = " with another --request-id (this one stays FAILED)" if getattr(args, "request_id", None) else ""
                print(f"  hint: retryable: run the command again{again}", file=stderr)
            if err.code == "DEADLINE_EXCEEDED" and err.reason == "DEADLINE_EXCEEDED":
                # The command's own deadline ("Deadline Exceeded" alone did not say whose).
                timeout = getattr(args, "timeout", None)
                print(f"  hint: the generation did not end within --timeout ({timeout or 600:g} s): "
                      "pass a larger --timeout for many steps or large images", file=stderr)  # fmt: skip
            return 1
    if output == "-":
        # The PNG on stdout (`-o - > fox.png`, `-o - | display`), as `-` reads the prompt from
        # stdin; the lines about it go to stderr. Before, `-o -` wrote a file named "-".
        stdout.flush()
        binary = getattr(stdout, "buffer", None)
        if binary is None:
            print("kvrelay generate: -o -: stdout takes no bytes here", file=stderr)
            return 1
        try:
            binary.write(result.png)
            binary.flush()
        except BrokenPipeError:
            raise  # the reader left: kvrelay.node.cli ends quietly, as a shell tool would
        except OSError as err:
            # A full disk behind `> fox.png` was a traceback. Nothing more can go to stdout: it
            # points at /dev/null from here, so the interpreter's last flush does not fail again.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
            print(f"kvrelay generate: cannot write the PNG to stdout: {err.strerror or err}", file=stderr)
            return 1
        stdout = stderr
        output = "stdout"
    else:
        try:
            result.save(output)
        except OSError as err:
            print(f"kvrelay generate: cannot write {output}: {err}", file=stderr)
            return 1
    print(
        f"wrote {output} ({result.width}x{result.height}, seed {result.seed}, request {_shown_id(result.request_id)})",
        file=stdout,
    )
    if not quiet:
        print(f"timings: {format_timings(result.timings)}", file=stdout)
    return 0


@contextlib.contextmanager
def _on_sigint(handler: Any) -> Iterator[None]:
    """``handler`` for SIGINT inside, the previous one restored after (only in the main thread,
    the one Python delivers signals to; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _cancel_unless(handle: GenerationHandle, cancelling: threading.Event) -> None:
    """Cancel ``handle`` unless ``cancelling`` is set within a second (the main thread got the
    KeyboardInterrupt and cancels itself)."""
    if cancelling.wait(1.0):
        return
    try:
        handle.cancel()
    except KvRelayError:
        pass  # the main thread's own cancel (a no-op after this one) reports nothing; the dropped stream cancels


def _cancel_on_interrupt(handle: GenerationHandle | None, stderr: TextIO) -> int:
    if handle is None:
        print("kvrelay generate: interrupted", file=stderr)
        return 130
    request = _shown_id(handle.request_id) if handle.request_id else "(not yet assigned)"
    print(f"kvrelay generate: interrupted; cancelling request {request}", file=stderr, flush=True)
    try:
        handle.cancel()
    except KvRelayError as err:
        # The dropped stream still cancels it server-side; say that the explicit cancel failed.
        _print_error("generate", err, stderr)
    return 130


# ---------------------------------------------------------------------------------------------
# kvrelay status
# ---------------------------------------------------------------------------------------------


def _printable(text: str) -> str:
    """`text` with every character a terminal would act on (C0/C1 controls, DEL, bidi and other
    format characters) written as its escape: table cells carry what other callers chose (an
    api client's prompt, a replica's id or reason), and the terminal is the operator's."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers)] + [["-" if v is None or v == "" else _printable(str(v)) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _age(when: _dt.datetime | None, now: _dt.datetime) -> str:
    if when is None:
        return "-"
    seconds = max(0.0, (now - when).total_seconds())
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _until(when: _dt.datetime | None, now: _dt.datetime) -> str:
    if when is None:
        return "-"
    return f"{(when - now).total_seconds():+.1f}s"


def replicas_table(replicas: Sequence[Replica], now: _dt.datetime) -> str:
    rows = [
        (
            r.replica_id,
            r.role.name.lower(),
            r.endpoint,
            f"tp{r.tensor_parallel_size}"
            + (f" sp{r.sequence_parallel_size}" if r.sequence_parallel_size > 1 else "")
            + (f" cfg{r.cfg_parallel_size}" if r.cfg_parallel_size > 1 else ""),
            r.transport.name.lower(),
            _liveness(r, now),
            "FENCED" if r.fenced else "",
            _until(r.lease_expire_time, now),
            r.incarnation_id[:8],
        )
        for r in sorted(replicas, key=lambda r: (r.role, r.replica_id))
    ]
    return format_table(
        ("REPLICA", "ROLE", "ENDPOINT", "PARALLEL", "TRANSPORT", "UP", "FENCED", "LEASE", "INCARNATION"), rows
    )


def forgotten_table(forgotten: Sequence[ForgottenIncarnation]) -> str:
    """Incarnations forgotten with `kvrelay forget --force` that the broker refuses, one line per
    replica id (how many, the latest), and what that means for a process that comes back."""
    by_id: dict[str, list[str]] = {}
    for f in forgotten:  # an id's oldest first, as the broker lists them
        by_id.setdefault(f.replica_id, []).append(f.incarnation_id)
    rows = [(rid, len(incs), incs[-1][:8]) for rid, incs in sorted(by_id.items())]
    return (
        format_table(("REFUSED (FORGOTTEN WITH --force)", "INCARNATIONS", "LATEST"), rows)
        + "\nA refused incarnation that comes back (cut off, not gone) is answered fenced and fails stop;"
        + "\nits restart (a new incarnation) registers normally."
    )


def refusals_table(refusals: Sequence[CredentialRefusal], now: _dt.datetime) -> str:
    """Replica ids the broker refuses for their credential (a rotated replica secret: replicas
    still on old tokens), and what to do about them."""
    rows = [
        (r.replica_id, r.reason, r.method, r.refusals,
         f"{_age(r.last_refusal_time, now)} ago" if r.last_refusal_time else "-")
        for r in refusals
    ]  # fmt: skip
    return (
        format_table(("REFUSED (CREDENTIAL)", "REASON", "LAST CALL", "REFUSALS", "LAST"), rows)
        + "\nThe broker does not take these replicas' tokens (REPLICA_TOKEN_MISMATCH: a token of an old replica"
        + "\nsecret or another id's): write each one's token, `kvrelay token ID` where the secret is, into its token"
        + "\nfile (a running replica re-reads it), or restart it with that token in its environment."
    )


def _liveness(r: Replica, now: _dt.datetime) -> str:
    """UP: yes, or why not with when it was last heard of. A replica the broker's journal kept
    (an earlier config's, or one that stopped) is listed, but no request goes to it."""
    if r.up:
        return "yes"
    if r.lease_expire_time is None:
        return "no (not seen since the broker started)"
    if r.lease_expire_time > now:
        # Not up while its lease runs: deregistered (it still heartbeats while its stop finishes
        # its writes). Found black-box: listed as "lease expired 0s ago" beside LEASE +1.6s.
        return "no (deregistered)"
    return f"no (lease expired {_age(r.lease_expire_time, now)} ago)"


def pools_table(pools: Sequence[PoolStatus]) -> str:
    """One line per DiT pool, then the capacity of the live ones. FREE of a pool whose replica is
    not live is '-': its pages stay accounted (in-doubt ones held) but no request can get them.
    Found black-box: an earlier config's replicas, kept in a shared journal, showed 4096 FREE."""
    rows = [
        (
            p.replica_id,
            "up" if p.up else "DOWN",
            p.total_pages,
            p.free_pages if p.up else "-",
            p.reserved_pages,
            p.draining_pages,
            "FENCED" if p.fenced else "",
        )
        for p in sorted(pools, key=lambda p: p.replica_id)
    ]
    table = format_table(("POOL", "STATE", "TOTAL", "FREE", "RESERVED", "DRAINING", "FENCED"), rows)
    live = [p for p in pools if p.up]
    down = [p for p in pools if not p.up]
    summary = (
        f"live: {len(live)} pool(s), {sum(p.total_pages for p in live)} pages, "
        f"{sum(p.available_pages for p in live)} available"
    )
    if down:
        summary += (
            f"; not live (not counted): {len(down)} pool(s), "
            f"{sum(p.reserved_pages + p.draining_pages for p in down)} pages still held"
        )
    return f"{table}\n{summary}"


def tickets_table(tickets: Sequence[Ticket], now: _dt.datetime) -> str:
    rows = []
    for t in sorted(tickets, key=lambda t: t.sequence):
        writes_done = sum(1 for w in t.writes if w.status not in _UNRESOLVED_WRITES)
        in_doubt = sum(1 for w in t.writes if w.status == WriteStatus.IN_DOUBT)
        loads_done = sum(1 for x in t.loads if x.loaded)
        rows.append(
            (
                t.ticket_id,
                t.request_id,
                t.state.name,
                t.outcome.name if t.outcome else "",
                t.ar_replica_id,
                t.dit_replica_id,
                t.num_pages,
                f"{writes_done}/{len(t.writes)}",
                in_doubt,
                f"{loads_done}/{len(t.loads)}",
                _age(t.create_time, now),
                t.reason,
            )
        )
    return format_table(
        ("TICKET", "REQUEST", "STATE", "OUTCOME", "AR", "DIT", "PAGES", "WRITES", "IN_DOUBT", "LOADS", "AGE",
         "REASON"),
        rows,
    )  # fmt: skip


# Writes that may still land: never reported, or reported IN_DOUBT (the sender stopped waiting
# while its transport call still runs). Their tickets hold their pages.
_UNRESOLVED_WRITES = frozenset({WriteStatus.UNSPECIFIED, WriteStatus.IN_DOUBT})


def in_doubt_table(tickets: Sequence[Ticket], now: _dt.datetime) -> str:
    """One line per in-doubt write, with the pages its ticket holds because of it."""
    rows = []
    for t in sorted(tickets, key=lambda t: t.sequence):
        for w in t.writes:
            if w.status == WriteStatus.IN_DOUBT:
                pages = sorted(p for r in t.rows for p in r.page_ids)
                rows.append((t.ticket_id, t.state.name, t.dit_replica_id, w.row, w.src_rank, w.dst_rank,
                             t.ar_replica_id, _page_ranges(pages), _age(t.update_time, now)))  # fmt: skip
    return format_table(
        ("IN-DOUBT WRITE OF", "STATE", "DIT", "ROW", "SRC", "DST", "WRITER", "HELD PAGES", "SINCE"), rows
    )


def _page_ranges(pages: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    start = prev = None
    for p in pages:
        if prev is not None and p == prev + 1:
            prev = p
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = p
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(out)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return len(value)
    return value


def run_status(args: argparse.Namespace) -> int:
    """`kvrelay status`: replicas, page pools and live tickets of a broker, as tables or JSON."""
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay status: {problem}", file=sys.stderr)
        return 2
    target = getattr(args, "target", None) or DEFAULT_TARGET
    try:
        token = _token(args, OPERATOR_TOKEN_ENV, TOKEN_ENV)
        with KvRelayClient(target, token=token, timeout=UNARY_TIMEOUT_S, **_tls(args)) as client:
            registry = client.get_replica_registry()
            pools = client.get_pools()
            tickets = client.list_tickets()
    except KvRelayError as err:
        _print_error("status", err, sys.stderr, tls=bool(_tls(args)), target=_target(args), sent=_sent_token("status", args))
        return 1
    if getattr(args, "json", False):
        doc = {"target": target, "replica_authentication": registry.replica_authentication,
               "replicas": registry.replicas, "forgotten_incarnations": registry.forgotten_incarnations,
               "credential_refusals": registry.credential_refusals,
               "credential_grace_seconds": registry.credential_grace_seconds, "pools": pools,
               "tickets": tickets}  # fmt: skip
        print(json.dumps(_jsonable(doc), indent=2))
        return 0
    now = _dt.datetime.now(_dt.UTC)
    print(f"broker {target}")
    if registry.replica_authentication:
        print(f"replicas authenticate with: {registry.replica_authentication}")
    if registry.credential_grace_seconds > 0:
        print(f"credential rotation grace: {math.ceil(registry.credential_grace_seconds)} s left (the credentials "
              "`kvrelay rotate-secrets` replaced are still taken until then)")
    print()
    replicas = registry.replicas
    print(replicas_table(replicas, now) if replicas else "REPLICAS: none registered")
    if registry.forgotten_incarnations:
        print()
        print(forgotten_table(registry.forgotten_incarnations))
    if registry.credential_refusals:
        print()
        print(refusals_table(registry.credential_refusals, now))
    print()
    print(pools_table(pools) if pools else "POOLS: none")
    print()
    print(tickets_table(tickets, now) if tickets else "TICKETS: none in flight")
    if any(w.status == WriteStatus.IN_DOUBT for t in tickets for w in t.writes):
        print()
        print(in_doubt_table(tickets, now))
    return 0


# ---------------------------------------------------------------------------------------------
# kvrelay list / kvrelay cancel
# ---------------------------------------------------------------------------------------------


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def generations_table(generations: Sequence[Generation], now: _dt.datetime) -> str:
    rows = []
    for g in generations:
        progress = f"{g.step}/{g.total_steps}" if g.total_steps else ""
        error = f"{g.error.code} {g.error.reason}" if g.error is not None else ""
        rows.append(
            (
                g.request_id,
                g.state.name,
                progress,
                _age(g.create_time, now),
                f"{g.timings.total_seconds:.2f}s" if g.timings is not None and g.state.is_terminal else "",
                error,
                _one_line(g.params.prompt, 40) if g.params is not None else "",
            )
        )
    return format_table(("REQUEST", "STATE", "STEP", "AGE", "TOTAL", "ERROR", "PROMPT"), rows)


def run_list(args: argparse.Namespace) -> int:
    """`kvrelay list`: the broker's generations, newest first (`--state RUNNING...` to filter)."""
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay list: {problem}", file=sys.stderr)
        return 2
    target = getattr(args, "target", None) or DEFAULT_TARGET
    names = [s.upper() for s in (getattr(args, "state", None) or [])]
    unknown = [n for n in names if n not in GenerationState.__members__ or n == "UNSPECIFIED"]
    if unknown:
        known = [s.name for s in GenerationState if s.name != "UNSPECIFIED"]
        named = ", ".join(f"{n}{did_you_mean(n, known)}" for n in unknown)
        print(f"kvrelay list: unknown state {named} (one of {', '.join(known)})", file=sys.stderr)
        return 2
    states = [GenerationState[n] for n in names] or None
    try:
        # Every client's generations: an operator RPC (the api token serves a development node).
        token = _token(args, OPERATOR_TOKEN_ENV, TOKEN_ENV)
        with KvRelayClient(target, token=token, timeout=UNARY_TIMEOUT_S, **_tls(args)) as client:
            # Without --limit, every generation the broker keeps: page after page (next_page_token).
            generations = _list_pages(client, states, int(getattr(args, "limit", 0) or 0))
    except KvRelayError as err:
        _print_error("list", err, sys.stderr, tls=bool(_tls(args)), target=_target(args), sent=_sent_token("list", args))
        return 1
    if getattr(args, "json", False):
        print(json.dumps(_jsonable({"target": target, "generations": generations}), indent=2))
        return 0
    if not generations:
        print("no generations" + (f" in state {', '.join(names)}" if names else ""))
        return 0
    print(generations_table(generations, _dt.datetime.now(_dt.UTC)))
    return 0


def _list_pages(
    client: KvRelayClient, states: list[GenerationState] | None, limit: int,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Generation]:  # fmt: skip
    """Generations newest first, following ListGenerations' pages until `limit` (0: all). A page
    refused RATE_LIMITED is asked again after the wait the broker names (retry_after_ms), up to
    LIST_RATE_WAIT_S in all: a page's reply counts its bytes against the caller's bucket, so a
    walk over many retained prompts (~8 MiB/s at the default limit) waits instead of failing."""
    generations: list[Generation] = []
    token = ""
    waited = 0.0
    while True:
        want = MAX_LIST_PAGE_SIZE if not limit else min(MAX_LIST_PAGE_SIZE, limit - len(generations))
        try:
            page = client.list_generations_page(states, page_size=want, page_token=token)
        except KvRelayError as err:
            wait = _rate_limit_wait(err)
            if wait is None or waited + wait > LIST_RATE_WAIT_S:
                raise
            sleep(wait)
            waited += wait
            continue
        generations += page.generations
        token = page.next_page_token
        if not token or (limit and len(generations) >= limit):
            return generations[:limit] if limit else generations


def _rate_limit_wait(err: KvRelayError) -> float | None:
    """The seconds a RATE_LIMITED refusal says to wait (ErrorInfo metadata retry_after_ms), or None."""
    if err.reason != "RATE_LIMITED":
        return None
    try:
        return max(0.0, int(err.details["retry_after_ms"]) / 1000)
    except (KeyError, ValueError):
        return None


def run_cancel(args: argparse.Namespace) -> int:
    """`kvrelay cancel REQUEST_ID...`: cancel generations by id (idempotent); prints each one's
    state after the call. Exit 1 when one could not be cancelled (unknown, already finished)."""
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay cancel: {problem}", file=sys.stderr)
        return 2
    target = getattr(args, "target", None) or DEFAULT_TARGET
    failed = 0
    with KvRelayClient(target, token=_token(args), timeout=UNARY_TIMEOUT_S, **_tls(args)) as client:
        for request_id in args.request_ids:
            try:
                generation = client.cancel_generation(request_id)
            except KvRelayError as err:
                _print_error("cancel", err, sys.stderr, tls=bool(_tls(args)), target=_target(args), sent=_sent_token("cancel", args))
                failed += 1
                continue
            print(f"{_shown_id(generation.request_id)} {generation.state.name}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# kvrelay forget
# ---------------------------------------------------------------------------------------------

# Answers about one replica id; any other error (credentials, the broker unreachable) is about
# every id, so the command stops at the first.
_PER_REPLICA_CODES = frozenset({"FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT"})


def run_forget(args: argparse.Namespace) -> int:
    """`kvrelay forget REPLICA_ID...`: forget replicas gone for good (docs/operations.md, Retiring
    a replica); one line per id, `ID forgotten` on stdout or `ID not forgotten: CODE (REASON): why`
    on stderr. Exit 0 only if every id was forgotten. `--all-down`: every replica that is not up,
    except those the broker must keep (they are listed with the reason, and do not fail the command).
    `--force`: the operator says they are gone for good: fenced ones and ones that live tickets name
    are forgotten too, ending those tickets (listed after the id); DiTs first with --all-down, and an
    AR refused REPLICA_WRITES_IN_DOUBT is tried once more after the other ids, since forgetting a
    DiT ends the tickets that keep an AR's in-doubt writes unresolved."""
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay forget: {problem}", file=sys.stderr)
        return 2
    ids: list[str] = list(getattr(args, "replica_ids", None) or [])
    all_down = bool(getattr(args, "all_down", False))
    force = bool(getattr(args, "force", False))
    if bool(ids) == all_down:
        print("kvrelay forget: name REPLICA_ID... or --all-down (one of the two)", file=sys.stderr)
        return 2
    target = _target(args)
    failed = 0
    try:
        token = _token(args, OPERATOR_TOKEN_ENV, TOKEN_ENV)
        with KvRelayClient(target, token=token, timeout=UNARY_TIMEOUT_S, **_tls(args)) as client:
            if all_down:
                down = [r for r in client.list_replicas() if not r.up]
                ids = [r.replica_id for r in sorted(down, key=lambda r: r.role is not ReplicaRole.DIT)]
                if not ids:
                    print("no replica is down")
                    return 0
            retried: list[str] = []
            for replica_id in ids:
                failed += _forget_one(client, replica_id, force=force, all_down=all_down, retry=retried)
            for replica_id in retried:  # after every other id: a DiT forgotten since may have freed them
                failed += _forget_one(client, replica_id, force=force, all_down=all_down, retry=None)
    except KvRelayError as err:
        _print_error("forget", err, sys.stderr, tls=bool(_tls(args)), target=target, sent=_sent_token("forget", args))
        return 1
    return 1 if failed else 0


def _forget_one(client: KvRelayClient, replica_id: str, *, force: bool, all_down: bool,
                retry: list[str] | None) -> int:
    """Forget one id and print its line; 1 if that counts as a failure of the command. An AR
    refused REPLICA_WRITES_IN_DOUBT under --force goes to `retry` (when given) instead, unprinted:
    a DiT named after it may end the tickets that hold it."""
    try:
        ended = client.forget_replica(replica_id, force=force)
    except KvRelayError as err:
        if err.code not in _PER_REPLICA_CODES:
            raise
        if retry is not None and err.reason == "REPLICA_WRITES_IN_DOUBT":
            retry.append(replica_id)
            return 0
        reason = f" ({err.reason})" if err.reason and err.reason != err.code else ""
        print(f"{_printable(replica_id)} not forgotten: {err.code}{reason}: {_printable(err.message)}",
              file=sys.stderr)
        # --all-down forgets what is safe to forget; what must be kept is no failure.
        return 0 if all_down and err.code == "FAILED_PRECONDITION" else 1
    shown = ", ".join(_printable(t) for t in ended[:8]) + (", ..." if len(ended) > 8 else "")
    tickets = f"{len(ended)} ticket" + ("s" if len(ended) > 1 else "")
    print(f"{_printable(replica_id)} forgotten" + (f" (ended {tickets}: {shown})" if ended else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# kvrelay rotate-secrets
# ---------------------------------------------------------------------------------------------


def run_rotate_secrets(args: argparse.Namespace) -> int:
    """`kvrelay rotate-secrets`: the broker re-reads its credential files and takes what changed,
    the replaced ones still taken for security.rotation_grace_seconds (docs/operations.md,
    Rotating the replica secret). One line per credential (`api_token: reloaded from
    security.api_token_file (...)`), then what happened. Exit 0 when the broker read every file
    (whether or not anything changed), 1 when it took nothing because one failed, or on any error."""
    if (problem := tls_problem(args)) is not None:
        print(f"kvrelay rotate-secrets: {problem}", file=sys.stderr)
        return 2
    target = _target(args)
    try:
        token = _token(args, OPERATOR_TOKEN_ENV, TOKEN_ENV)
        with KvRelayClient(target, token=token, timeout=UNARY_TIMEOUT_S, **_tls(args)) as client:
            answer = client.reload_credentials()
    except KvRelayError as err:
        _print_error("rotate-secrets", err, sys.stderr, tls=bool(_tls(args)), target=target,
                     sent=_sent_token("rotate-secrets", args))  # fmt: skip
        return 1
    if getattr(args, "json", False):
        print(json.dumps(_jsonable({"target": target, **dataclasses.asdict(answer)}), indent=2))
        return 1 if answer.error else 0
    for source in answer.sources:
        print(f"{source.key}: {source.state} ({_printable(source.source)})")
    if answer.error:
        print(f"kvrelay rotate-secrets: nothing taken: {_printable(answer.error)}", file=sys.stderr)
        return 1
    if answer.rotated:
        print("new credentials taken" + (f"; the replaced ones are still taken for {answer.grace_seconds:.0f} s"
                                         if answer.grace_seconds > 0 else ""))  # fmt: skip
    else:
        print("nothing changed" + (f" (the last rotation's replaced credentials are taken {answer.grace_seconds:.0f} s more)"
                                   if answer.grace_seconds > 0 else ""))  # fmt: skip
    if any(s.state == "not reloadable" for s in answer.sources):
        print("a credential from an environment variable cannot be re-read by a running broker: restart it to change "
              "that one (or give it a file: security.*_file)")  # fmt: skip
    return 0


__all__ = [
    "format_table", "format_timings", "generations_table", "read_prompt",
    "run_cancel", "run_forget", "run_generate", "run_list", "run_rotate_secrets", "run_status",
]  # fmt: skip
