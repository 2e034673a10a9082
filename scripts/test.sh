#!/usr/bin/env bash
# Set up (if needed), then run every check CI runs: lint, architecture contracts, types, tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k broker
set -euo pipefail
cd "$(dirname "$0")/.."
# --vllm: CI runs the tests of the AR's engine: vllm too (tests/vllm); --compose: and tests/compose.
./scripts/setup.sh --vllm --compose
export PATH="$PWD/.venv/bin:$PATH"

echo "== ruff"; ruff check .
echo "== import-linter"; ./scripts/lint_imports.sh
echo "== mypy --strict over the package (exceptions: pyproject's [[tool.mypy.overrides]])"
./scripts/mypy.sh
echo "== pytest"
set +e
pytest -q -p no:cacheprovider --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
exit "$rc"
