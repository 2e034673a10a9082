"""kvrelay.node: the composition roots, the one room above the services.

It owns what wires the broker, AR, DiT and client packages together into something a person runs:
the `kvrelay` command line (cli), `kvrelay up` (supervisor: the node's child processes), `kvrelay
bench` and `kvrelay verify`, the colocated AR + DiT pipeline they compare against, and `kvrelay
health` (health_probe). Nothing else imports this package (import-linter contracts in pyproject.toml):
the shared core below it imports no service, and the services and the client import no kvrelay.node.
This __init__ imports nothing: `import kvrelay.node.cli` must stay as light as `import kvrelay`.
"""
