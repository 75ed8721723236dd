#!/usr/bin/env bash
# Creates (or completes) the project's virtual environment: TensorFlow 2.17.1, Horovod 0.28.1
# built with gloo, gRPC pinned to the protobuf 4.25 runtime TF brings, and parallax itself
# (editable). Idempotent: each stage leaves a stamp in the venv and is skipped when present.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PARALLAX_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamps="$venv/.parallax-stamps"

log() { printf '[setup] %s\n' "$*"; }
done_stage() { [ -f "$stamps/$1" ] && [ "$(cat "$stamps/$1")" = "$2" ]; }
mark_stage() { mkdir -p "$stamps"; printf '%s' "$2" >"$stamps/$1"; }

# WordNet's glosses are the corpus of examples/language_model.py (Debian's wordnet-base).
# Installed when missing if we are root with apt-get; otherwise only a warning (the example
# then says what to install). A failure here never stops the setup.
if [ ! -f /usr/share/wordnet/data.noun ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "installing Debian's wordnet-base (corpus of examples/language_model.py)"
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wordnet-base; }
    apt_install || { apt-get update && apt_install; } \
      || echo "[setup] warning: could not install wordnet-base; examples/language_model.py needs it" >&2
  else
    echo "[setup] warning: /usr/share/wordnet is missing and cannot be installed here (needs root and" \
         "apt-get): examples/language_model.py needs it; run 'apt-get install wordnet-base' as root" >&2
  fi
fi

# sshd for tests/parallel/test_multihost.py (two network namespaces, each a "host" with its own
# sshd):
# installed when missing if we are root with apt-get; otherwise that test fails saying so.
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    log "installing Debian's openssh-server (sshd for tests/parallel/test_multihost.py)"
    ssh_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server; }
    ssh_install || { apt-get update && ssh_install; } \
      || echo "[setup] warning: could not install openssh-server; tests/parallel/test_multihost.py needs sshd" >&2
  fi
fi

if ! "$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
  echo "[setup] $python is Python $("$python" -c 'import platform; print(platform.python_version())'):" \
       "TensorFlow 2.17.1 needs 3.10-3.12; run with PYTHON=python3.11 (for example)" >&2
  exit 1
fi
if ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  echo "[setup] no C++ compiler found: Horovod is built from source; install g++ (Debian: apt-get install g++)" >&2
  exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
  log "creating virtual environment at $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

base_reqs="$root/requirements/base.txt"
base_key="$(sha256sum "$base_reqs" | cut -c1-16)"
if ! done_stage base "$base_key"; then
  log "installing TensorFlow, gRPC and build tools (about a minute)"
  "${pip[@]}" install --upgrade pip setuptools wheel
  "${pip[@]}" install -r "$base_reqs"
  mark_stage base "$base_key"
fi

# Horovod is built from source against the TensorFlow just installed (pip's own wheel cache
# is not used: it keys a build by Horovod's version alone, and a build against another
# TensorFlow does not load). The wheel is kept under a key of everything it was built
# against (Horovod, TensorFlow, Python, machine), so a second checkout on the same machine
# installs it in seconds; PARALLAX_WHEEL_CACHE=off builds every time.
horovod_build() {
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "${pip[@]}" "$@" --no-build-isolation --no-cache-dir horovod==0.28.1
}
if ! done_stage horovod 0.28.1; then
  built_for="$("$venv/bin/python" -c 'import platform, sys, tensorflow as tf
print(f"horovod-0.28.1-tf{tf.__version__}-cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")' 2>/dev/null)"
  wheels="${PARALLAX_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/parallax/wheels}/$built_for"
  if [ -n "$built_for" ] && [ "${PARALLAX_WHEEL_CACHE:-}" != off ] && ls "$wheels"/horovod-*.whl >/dev/null 2>&1; then
    log "installing Horovod 0.28.1 built earlier for this TensorFlow and Python ($wheels)"
    "${pip[@]}" install "$wheels"/horovod-*.whl
  elif [ -n "$built_for" ] && [ "${PARALLAX_WHEEL_CACHE:-}" != off ] && mkdir -p "$wheels" 2>/dev/null; then
    log "building Horovod 0.28.1 with gloo against TensorFlow (about 4 minutes on 2 cores; kept in $wheels)"
    partial="$wheels.partial.$$"  # (another checkout may be building beside this one)
    horovod_build wheel --no-deps -w "$partial"
    mv "$partial"/horovod-*.whl "$wheels"/ && rmdir "$partial"
    "${pip[@]}" install "$wheels"/horovod-*.whl
  else
    log "building Horovod 0.28.1 with gloo against TensorFlow (about 4 minutes on 2 cores)"
    horovod_build install
  fi
  "$venv/bin/python" -c "import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'Horovod was built without gloo'"
  mark_stage horovod 0.28.1
fi

# the compiled kernels' sources are in the key: a change to them rebuilds the extension
project_key="$(cat "$root/setup.cfg" "$root/pyproject.toml" "$root/setup.py" \
  "$root"/parallax/native/src/* | sha256sum | cut -c1-16)"
if ! done_stage project "$project_key"; then
  log "installing parallax (editable) with its test and benchmark dependencies"
  "${pip[@]}" install --no-build-isolation -e "$root[test,bench]"
  # the compiled kernels are optional (pure Python otherwise): say when they did not build
  "$venv/bin/python" -c 'from parallax import native; import sys; d = native.describe(); print("[setup] data path:", d); sys.exit(not d.startswith("native"))' \
    || echo "[setup] warning: parallax's compiled kernels did not build (see the pip output above); the pure-Python data path runs" >&2
  mark_stage project "$project_key"
fi
log "environment ready: $venv"
