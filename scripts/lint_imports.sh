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
# A contract may name a module that a later change adds; check what exists, say what is skipped.
"$OLDPWD/.venv/bin/python" - <<'PY'
import pathlib, re
p = pathlib.Path("pyproject.toml"); text = p.read_text()
def exists(mod):
    path = pathlib.Path(*mod.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or not mod.startswith("kvrelay")
def keep(m):
    names = [n.strip().strip('"') for n in m.group(2).split(",") if n.strip()]
    missing = [n for n in names if not exists(n)]
    if missing:
        print("lint-imports: not present yet, skipped:", ", ".join(missing))
    return m.group(1) + "[" + ", ".join(f'"{n}"' for n in names if exists(n)) + "]"
text = re.sub(r'^((?:source_modules|forbidden_modules|modules) = )\[(.*?)\]', keep, text, flags=re.M)
p.write_text(text)
PY
PYTHONPATH="$stage" "${LINT_IMPORTS:-$OLDPWD/.venv/bin/lint-imports}" --config pyproject.toml --no-cache
