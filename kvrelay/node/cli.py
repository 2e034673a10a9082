"""The `kvrelay` command line, the entry point of kvrelay.node (the composition roots).

It parses arguments and imports a service package only inside the subcommand that starts it, so
`kvrelay generate` never loads torch and `kvrelay broker` never loads a model.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from kvrelay import __version__
from kvrelay.errors import MAX_DEADLINE_SECONDS
from kvrelay.models.presets import PRESETS
from kvrelay.suggest import SuggestingArgumentParser, did_you_mean

# Not kvrelay.config (pydantic, PyYAML): the client commands (generate, status, list, cancel,
# forget) run where only the SDK's grpcio, grpcio-status and protobuf are installed
# (docs/operations.md, Install). kvrelay.config.DEFAULT_CONFIG is the same (tests/cli).
DEFAULT_CONFIG = "configs/single-node.yaml"

# subcommand -> "module:function(args) -> int"
HANDLERS = {
    "up": "kvrelay.node.supervisor:run_up",
    "broker": "kvrelay.broker.main:run",
    "ar": "kvrelay.ar_service.main:run",
    "dit": "kvrelay.dit_service.main:run",
    "generate": "kvrelay.client.cli:run_generate",
    "status": "kvrelay.client.cli:run_status",
    "health": "kvrelay.node.health_probe:run",
    "list": "kvrelay.client.cli:run_list",
    "cancel": "kvrelay.client.cli:run_cancel",
    "forget": "kvrelay.client.cli:run_forget",
    "rotate-secrets": "kvrelay.client.cli:run_rotate_secrets",
    "bench": "kvrelay.node.bench:run",
    "verify": "kvrelay.node.verify:run",
    "token": "kvrelay.node.tokens:run",
}

DEFAULT_TARGET = "127.0.0.1:50051"
PRESET_NAMES = ", ".join(PRESETS)
CONFIG_HELP = f"deployment YAML (default: $KVRELAY_CONFIG, else {DEFAULT_CONFIG})"
INSECURE_BIND_HELP = (
    "listen on a non-loopback address although no replica token or mutual TLS is configured "
    "(any caller on that network may then call every RPC)"
)



# argparse types: a count or a timeout that can only mean a mistake is a usage error (exit 2) here,
# not an empty benchmark table or a deadline that expired before the call.
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_DEADLINE_SECONDS:
        # 1e10 passed, and `generate --timeout 1e10` ended DEADLINE_EXCEEDED at once, before
        # sending anything (gRPC cannot hold a deadline past 2262).
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds, at most {MAX_DEADLINE_SECONDS:g}, got {text}"
        )
    return value

def _port(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535] (0 = any free port), got {value}")
    return value


# OSErrors about a path (a file or folder named on the command line, in the environment or in
# the config) that main() reports as one line: `kvrelay up --log-dir FILE/logs`, `--tls-ca MISSING`.
# A write to stdout that fails (a full disk or quota, a file too large, an I/O error) ends the
# client commands with one line, exit 1: they print nothing else without a file name.
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
OUTPUT_COMMANDS = frozenset({"generate", "status", "health", "list", "cancel", "forget", "rotate-secrets"})
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown level {text!r}{did_you_mean(level, LOG_LEVELS)} (one of {', '.join(LOG_LEVELS)})"
        )
    return level


def _target(text: str) -> str:
    """HOST[:PORT] of a kvrelay process; a port outside [1, 65535] was taken modulo 65536 by gRPC
    (127.0.0.1:99999 dialled 127.0.0.1:34463)."""
    _, sep, port = text.rpartition(":")
    if sep and port.isdigit() and not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} of {text} is not a TCP port in [1, 65535]")
    return text


def _add_client_tls_args(p: argparse.ArgumentParser, peer: str = "broker") -> None:
    p.add_argument("--tls-ca", default=None, help=f"PEM roots of a TLS {peer} (default: $KVRELAY_TLS_CA)")
    p.add_argument("--tls-cert", default=None, help="client certificate for mutual TLS (default: $KVRELAY_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="client key for mutual TLS (default: $KVRELAY_TLS_KEY)")


def _add_service_args(p: argparse.ArgumentParser, replica: bool) -> None:
    p.add_argument("--config", default=None, help=CONFIG_HELP)
    p.add_argument("--host", default=None, help="address to listen on (default: the config's host, 127.0.0.1)")
    p.add_argument("--port", type=_port, default=None,
                   help="gRPC port to listen on (0 = any free port; default: the config's, + --replica for ar/dit)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="Prometheus port (0 = any free port; default: the config's, + --replica for ar/dit)")
    p.add_argument("--log-level", type=_log_level, default=None,
                   help=f"{', '.join(LOG_LEVELS)} (default: INFO or $KVRELAY_LOG_LEVEL)")
    p.add_argument("--insecure-bind", action="store_true", help=INSECURE_BIND_HELP)
    if replica:
        p.add_argument("--replica", type=int, default=0, help="replica index within the stage (default: 0)")
        p.add_argument("--broker", type=_target, default=None,
                       help="broker address HOST:PORT (default: from the config)")
        p.add_argument(
            "--advertise-host", default=None,
            help="the address the broker and the other replicas reach this replica at, its gRPC endpoint and "
            "Mooncake session (default: the stage's advertise_host); across hosts, this host's address",
        )


def build_parser() -> argparse.ArgumentParser:
    # Its subcommands' parsers are of its class: every `choices=` refusal says which one was meant.
    parser = SuggestingArgumentParser(
        prog="kvrelay",
        description="Disaggregated text-to-image serving: AR prefill -> KV relay over Mooncake -> DiT denoise.",
    )
    parser.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("up", help="start the broker and every AR/DiT replica of a config; Ctrl-C stops all")
    p.add_argument("--config", default=None, help=CONFIG_HELP)
    p.add_argument("--host", default=None, help="address every process listens on (default: the config's)")
    p.add_argument("--log-dir", default=None, help="write each child's log here instead of the terminal")
    p.add_argument("--log-level", type=_log_level, default=None,
                   help=f"log level for every child: {', '.join(LOG_LEVELS)} (default: INFO or $KVRELAY_LOG_LEVEL)")
    p.add_argument("--ready-timeout", type=_positive_float, default=300.0,
                   help="seconds to wait for every process to be SERVING (default: %(default)g)")
    p.add_argument(
        "--metrics-port", type=_port, default=9399,
        help="the node's one Prometheus target: every process's metrics, label process "
        "(default: %(default)s; 0 = any free port)",
    )  # fmt: skip
    p.add_argument("--insecure-bind", action="store_true", help=INSECURE_BIND_HELP)

    p = sub.add_parser("broker", help="run the broker: registry, pages, tickets, journal and the public API")
    _add_service_args(p, replica=False)

    p = sub.add_parser("ar", help="run one AR replica (prefill + KV sender)")
    _add_service_args(p, replica=True)

    p = sub.add_parser("dit", help="run one DiT replica (page memory + denoiser)")
    _add_service_args(p, replica=True)

    p = sub.add_parser("generate", help="generate one image and write it as PNG")
    p.add_argument("prompt", nargs="?", default=None, help="the text prompt (- reads it from stdin)")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file (- = stdin)")
    p.add_argument("--negative-prompt", default="", help="negative prompt (CFG row 1; default: none)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: assigned by the server)")
    p.add_argument("--width", type=int, default=512, help="pixels, a multiple of 16 in [64, 2048] (default: %(default)s)")
    p.add_argument("--height", type=int, default=512, help="pixels, like --width (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="num_inference_steps (default: %(default)s)")
    p.add_argument("--guidance-scale", type=float, default=2.0, help="CFG scale; 1.0 = no CFG (default: %(default)s)")
    p.add_argument("-o", "--output", default="out.png", help="PNG path; - writes the PNG to stdout (default: %(default)s)")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument("--request-id", default=None,
                   help="idempotency key; re-running attaches to it (default: a fresh UUID)")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="deadline of the whole generation in seconds (default: 600)")
    p.add_argument("--token", default=None, help="bearer token for the public API (default: $KVRELAY_API_TOKEN)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_client_tls_args(p)

    p = sub.add_parser("status", help="show replicas, page pools and tickets")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--token", default=None, help="operator token (default: $KVRELAY_OPERATOR_TOKEN, else $KVRELAY_API_TOKEN)"
    )
    _add_client_tls_args(p)

    p = sub.add_parser("health", help="one gRPC health check; exit 0 only if SERVING (container healthchecks)")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="HOST[:PORT] of any kvrelay process; no port means the broker's 50051 (default: %(default)s)")
    p.add_argument("--service", default="", help="grpc.health.v1 service name (default: the whole process)")
    p.add_argument("--timeout", type=_positive_float, default=3.0,
                   help="seconds to wait for the answer (default: %(default)s)")
    _add_client_tls_args(p, peer="process (broker, AR or DiT)")

    p = sub.add_parser("list", help="list generations, newest first")
    p.add_argument("--state", action="append", default=None,
                   help="only this state (QUEUED, PREFILLING, ..., SUCCEEDED, FAILED, CANCELLED); repeatable")
    p.add_argument("--limit", type=_non_negative_int, default=0, help="at most this many (default: all the broker keeps)")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--token", default=None, help="operator token (default: $KVRELAY_OPERATOR_TOKEN, else $KVRELAY_API_TOKEN)"
    )
    _add_client_tls_args(p)

    p = sub.add_parser("cancel", help="cancel generations by request id (idempotent)")
    p.add_argument("request_ids", nargs="+", metavar="REQUEST_ID",
                   help="the id kvrelay generate printed (request ...), or one kvrelay list shows")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument("--token", default=None, help="bearer token for the public API (default: $KVRELAY_API_TOKEN)")
    _add_client_tls_args(p)

    p = sub.add_parser("forget", help="forget replicas gone for good (not up, no live ticket) from the broker")
    p.add_argument("replica_ids", nargs="*", metavar="REPLICA_ID",
                   help="ar-0, dit-1, ... as kvrelay status lists them (or --all-down)")
    p.add_argument("--all-down", action="store_true",
                   help="every replica that is not up, except those the broker must keep (listed with why)")
    p.add_argument("--force", action="store_true",
                   help="the replicas are gone for good: forget fenced ones and ones live tickets name too, ending "
                        "those tickets (their generations run again on another replica while "
                        "broker.max_replica_retries allows; never one that is up, nor an AR whose "
                        "writes may still land)")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument(
        "--token", default=None, help="operator token (default: $KVRELAY_OPERATOR_TOKEN, else $KVRELAY_API_TOKEN)"
    )
    _add_client_tls_args(p)

    p = sub.add_parser("rotate-secrets",
                       help="the broker re-reads its credential files (replica secret or token, api and operator "
                            "tokens) and takes what changed, the replaced ones still taken for a grace period")
    p.add_argument("--target", type=_target, default=DEFAULT_TARGET, help="broker HOST:PORT (default: %(default)s)")
    p.add_argument(
        "--token", default=None, help="operator token (default: $KVRELAY_OPERATOR_TOKEN, else $KVRELAY_API_TOKEN)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_client_tls_args(p)

    p = sub.add_parser("token", help="print a replica's own token (bound replica tokens), from the broker's secret")
    p.add_argument("replica_ids", nargs="+", metavar="REPLICA_ID",
                   help="ar-0, dit-1, ...; several: one 'ID TOKEN' line each")
    p.add_argument("--config", default=None, help=CONFIG_HELP + "; its security section names the secret")

    p = sub.add_parser("bench", help="the seed's throughput experiment: Mooncake vs gRPC fallback vs colocated")
    p.add_argument("--config", default=None, help=f"base config (default: $KVRELAY_CONFIG, else {DEFAULT_CONFIG}, the shipped CPU node)")
    p.add_argument("--preset", default=None, help=f"model preset for both stages: {PRESET_NAMES} (default: the "
                   "config's AR preset; small when it has none, as the default config's demo model)")
    p.add_argument("--requests", type=_positive_int, default=20, help="requests per run (default: %(default)s)")
    p.add_argument("--runs", type=_positive_int, default=2,
                   help="independent runs per implementation (default: %(default)s)")
    p.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (default: %(default)s)")
    p.add_argument("--width", type=int, default=512, help="seed workload (default: %(default)s)")
    p.add_argument("--height", type=int, default=512, help="seed workload (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="seed workload (default: %(default)s)")
    p.add_argument("--guidance-scale", type=float, default=2.0, help="seed workload (default: %(default)s)")
    p.add_argument("--impls", default="mooncake,grpc,colocated",
                   help="comma list of mooncake, grpc, cuda_ipc, colocated, vllm (default: %(default)s)")
    p.add_argument("--colocated", action="store_true", help="run only the colocated (no transfer) baseline")
    p.add_argument(
        "--dit-parallel", action="store_true",
        help="compare DiT layouts instead of transports (Mooncake nodes, same concurrency/batching): TP=1, "
        "CFG=2 x TP=1, TP=2 EP off, TP=2 EP on; prints EP on/off and CFG-parallel on/off ratios (use a MoE preset)",
    )
    p.add_argument("--scenario", default="seed", choices=["seed", "transfer", "both"], help="workload (default: %(default)s)")
    p.add_argument("--dataset", default="benchmarks/data/t2i-50.jsonl",
                   help="JSONL of prompts (default: %(default)s, shipped with kvrelay)")
    p.add_argument("--output", default="benchmarks/results/latest",
                   help="folder for JSON and plots (default: %(default)s)")
    p.add_argument("--warmup", type=_non_negative_int, default=2, help="warm-up requests per node (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="override every stage's max_num_seqs (DiT batch size; the colocated baseline batches alike)")
    p.add_argument(
        "--ar-model",
        default=None,
        help="a Llama/Qwen2 checkpoint directory for the AR of every node (built-in AR and, with impl vllm, "
        "vLLM on the same weights and tokenizer); see docs/ar.md",
    )

    p = sub.add_parser("verify", help="bit-for-bit check: Mooncake vs fallback vs local prefill")
    p.add_argument("--preset", default=None,
                   help=f"model preset: {PRESET_NAMES} (default: tiny on cpu, bagel-7b-shape on cuda)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: models on the GPU and CUDA IPC checked too (default: %(default)s)")
    p.add_argument("--prompt", default="a red fox in the snow, watercolor", help="CFG row 0 (default: %(default)r)")
    p.add_argument("--negative-prompt", default="blurry", help="CFG row 1 (default: %(default)r)")
    p.add_argument("--ar-tp", type=_positive_int, default=1, help="the sender's TP ranks (default: %(default)s)")
    p.add_argument("--dit-tp", type=_positive_int, default=1, help="the receiver's TP ranks (default: %(default)s)")
    p.add_argument("--dit-sp", type=_positive_int, default=1, help="the receiver's SP ranks (default: %(default)s)")
    p.add_argument(
        "--dit-cfg", type=int, default=1, choices=(1, 2),
        help="2: the receiver is a CFG-parallel DiT (cfg_parallel_size 2): each row only on its group's ranks "
        "(default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed of the random models (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the `kvrelay` command (python -m kvrelay has caught them already)
        from kvrelay import early_signals

        early_signals.catch(sys.argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # A flag the subcommand does not have: its own usage and prefix (`kvrelay generate: error:
        # unrecognized arguments: --bogus`), not the top-level one, which lists only COMMAND.
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = commands.choices.get(args.command) or parser
        flags = [flag for action in command._actions for flag in action.option_strings]
        # `--confg`: the flag it was meant to be, as a misspelt config key says the key.
        hints = "".join(did_you_mean(arg.split("=", 1)[0], flags) for arg in extra if arg.startswith("--"))
        command.error(f"unrecognized arguments: {' '.join(extra)}{hints}")
    if not args.command:
        parser.print_help()
        return 2
    env_level = os.environ.get("KVRELAY_LOG_LEVEL")
    if env_level and env_level.upper() not in LOG_LEVELS:
        hint = did_you_mean(env_level.upper(), LOG_LEVELS)
        print(f"kvrelay {args.command}: $KVRELAY_LOG_LEVEL: unknown level {env_level!r}{hint} (one of {', '.join(LOG_LEVELS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    if "config" in vars(args) and not args.config:
        # Resolved once here, so that every handler (and every child `kvrelay up` starts) sees the
        # same file: an explicit --config wins, then $KVRELAY_CONFIG, then the shipped default.
        from kvrelay.config import default_config_path

        args.config = default_config_path()
    # Before any handler imports gRPC: its core's INFO lines ("Got goaway" when a peer stops) are
    # noise on a terminal. kvrelay/logging.py (GRPC_CORE_LOG_DEFAULTS) says why; not imported
    # here, so that client commands need no structlog. A user's GRPC_VERBOSITY or GRPC_TRACE wins.
    if not os.environ.get("GRPC_TRACE"):
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    module_name, func_name = HANDLERS[args.command].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            print(f"kvrelay {args.command}: not available yet in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    handler = getattr(module, func_name)
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kvrelay list | head`: the reader left. Quietly, as a shell tool killed by SIGPIPE would
        # (exit 128 + SIGPIPE), and with stdout pointed at /dev/null so that the interpreter's
        # final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:
        # A file named on the command line or in the environment (a TLS certificate, a prompt
        # file) that cannot be read: one line naming it, as for every other bad input. Other
        # OSErrors are not input errors and keep their traceback.
        if err.filename is None and err.errno in OUTPUT_ERRNOS and args.command in OUTPUT_COMMANDS:
            # `kvrelay status > report.txt` on a full disk was an OSError traceback from print():
            # these commands write nothing else without a file name. stdout then points at
            # /dev/null, so that the interpreter's final flush does not fail again.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print(f"kvrelay {args.command}: cannot write its output: {err.strerror or err}", file=sys.stderr)
            return 1
        if err.filename is None or not isinstance(err, PATH_ERRORS):
            raise
        print(f"kvrelay {args.command}: {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    except Exception as err:
        # An SDK error a client command did not catch where it builds its client (a --token or
        # $KVRELAY_API_TOKEN that is not printable ASCII was a traceback from generate and
        # cancel): one line, as the commands print the errors they do catch.
        from kvrelay.client.errors import KvRelayError

        if not isinstance(err, KvRelayError):
            raise
        print(f"kvrelay {args.command}: {err.code}: {err.message}", file=sys.stderr)
        for key, value in sorted(err.details.items()):
            print(f"  {key}: {value}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # `python -m kvrelay.node.cli` (the console script's own module) ran nothing and exited 0.
    raise SystemExit(main())
