"""`kvrelay token REPLICA_ID`: print a replica's bound token (security.replica_tokens: bound).

Derives the token from the broker's secret (security.replica_secret_env / _file of the config)
on the machine that holds the secret, for the replica's environment or its token file
(`security.replica_token_file: secrets/{name}.token`). It never prints the secret.
"""

from __future__ import annotations

import argparse
import sys

from kvrelay.config import ConfigError, load_config
from kvrelay.security import SecurityError, read_replica_secret, replica_token_for


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        secret = read_replica_secret(cfg.security)
        if secret is None:
            raise SecurityError(
                f"no replica secret: set ${cfg.security.replica_secret_env or 'KVRELAY_REPLICA_SECRET'} or "
                "security.replica_secret_file (the broker's secret, which bound replica tokens derive from)"
            )
        tokens = [replica_token_for(secret, replica_id) for replica_id in args.replica_ids]
    except (ConfigError, SecurityError) as err:
        print(f"kvrelay token: {err}", file=sys.stderr)
        return 2
    if len(tokens) == 1:
        print(tokens[0])
    else:
        for replica_id, token in zip(args.replica_ids, tokens, strict=True):
            print(f"{replica_id} {token}")
    return 0
