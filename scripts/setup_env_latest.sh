#!/usr/bin/env bash
# Creates (or completes) the second environment, .venv-latest: the newest TensorFlow
# (requirements/latest.txt), no Horovod, and parallax itself (editable). Several workers there
# use TensorFlow's own collectives. Idempotent, with stamps like scripts/setup_env.sh.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PARALLAX_LATEST_VENV:-$root/.venv-latest}"
python="${PYTHON:-python3}"
stamps="$venv/.parallax-stamps"

log() { printf '[setup-latest] %s\n' "$*"; }
done_stage() { [ -f "$stamps/$1" ] && [ "$(cat "$stamps/$1")" = "$2" ]; }
mark_stage() { mkdir -p "$stamps"; printf '%s' "$2" >"$stamps/$1"; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment at $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

reqs="$root/requirements/latest.txt"
key="$(cat "$reqs" "$root/setup.cfg" "$root/pyproject.toml" "$root/setup.py" \
  "$root"/parallax/native/src/* | sha256sum | cut -c1-16)"
if ! done_stage latest "$key"; then
  log "installing the newest TensorFlow and parallax (about two minutes)"
  "${pip[@]}" install --upgrade pip setuptools wheel
  "${pip[@]}" install -r "$reqs"
  "${pip[@]}" install --no-build-isolation -e "$root"  # [test] pins protobuf 4's generator
  mark_stage latest "$key"
fi
"$venv/bin/python" -c 'import tensorflow as tf, parallax; print("[setup-latest] TensorFlow", tf.__version__)' 2>/dev/null
log "environment ready: $venv"
