import sys

from kvrelay import early_signals

early_signals.catch(sys.argv)  # before the service's imports: a stop signal meanwhile is kept

from kvrelay.node.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
