#!/usr/bin/env bash
# Check the import-linter contracts (pyproject.toml) against the package as it is installed: the
# service folders mapped under kvrelay/ exactly as in the wheel (DESIGN.md section 2).
set -euo pipefail
cd "$(dirname "$0")/.."
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/kvrelay"
tar -C kvrelay --exclude=__pycache__ -cf - . | tar -C "$stage/kvrelay" -xf -
for pair in broker:broker ar_service:ar_service dit_service:dit_service client:client; do
  src="${pair%%:*}"; dst="${pair##*:}"
  mkdir -p "$stage/kvrelay/$dst"
  tar -C "$src" --exclude=__pycache__ -cf - . | tar -C "$stage/kvrelay/$dst" -xf -
done
cp pyproject.toml "$stage/"
cd "$stage"
# Every kvrelay module a contract names must exist: a contract about a module that is not there
# (renamed, moved, misspelt) would hold vacuously, so it fails the lint instead.
"$OLDPWD/.venv/bin/python" - <<'PY'
import pathlib, re, sys
text = pathlib.Path("pyproject.toml").read_text()
def exists(mod):
    path = pathlib.Path(*mod.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or not mod.startswith("kvrelay")
missing = sorted(
    name
    for m in re.finditer(r'^(?:source_modules|forbidden_modules|modules) = \[(.*?)\]', text, flags=re.M)
    for name in (n.strip().strip('"') for n in m.group(1).split(","))
    if name and not exists(name)
)
if missing:
    sys.exit("lint-imports: contracts name modules that do not exist: " + ", ".join(missing))
PY
PYTHONPATH="$stage" "${LINT_IMPORTS:-$OLDPWD/.venv/bin/lint-imports}" --no-cache  # finds ./pyproject.toml (--config is deprecated: a DeprecationWarning on every run)
