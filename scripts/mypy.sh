#!/usr/bin/env bash
# mypy --strict over the whole package as it is installed: the service folders mapped under
# kvrelay/ exactly as in the wheel (pyproject's package-dir), so that `kvrelay.broker.x` imports
# resolve to broker/x.py and are checked, not taken as Any. The few exceptions are in pyproject
# ([[tool.mypy.overrides]]), each with its reason. Errors are printed with the repository's paths.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/kvrelay"
for entry in kvrelay/*; do
  ln -s "$root/$entry" "$stage/kvrelay/"
done
for dir in broker ar_service dit_service client; do
  ln -s "$root/$dir" "$stage/kvrelay/$dir"
done
cp pyproject.toml "$stage/"
cd "$stage"
set +e
"${MYPY:-$root/.venv/bin/mypy}" --strict --cache-dir "$root/.mypy_cache" -p kvrelay "$@" >"$stage/out" 2>&1
rc=$?
set -e
sed -E 's#^kvrelay/(broker|ar_service|dit_service|client)/#\1/#' "$stage/out"
exit "$rc"
