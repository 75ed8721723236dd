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

# Horovod is built from source against the TensorFlow just installed. pip's own wheel cache
# is not used: it keys a build by Horovod's version alone, and a build against another
# TensorFlow does not load. The stage's key, and the wheel kept under
# ~/.cache/parallax/wheels/KEY (PARALLAX_WHEEL_CACHE=DIR keeps it elsewhere, =off builds every
# time), name everything the build depends on: Horovod, TensorFlow, Python, the machine and
# the HOROVOD_* build settings. A second checkout on the machine installs it in seconds.
horovod_key="$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c 'import platform, sys, tensorflow as tf
print(f"horovod-0.28.1-tf{tf.__version__}-cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')" \
  || { echo "[setup] TensorFlow does not import in $venv (its error is above); Horovod is built against it" >&2; exit 1; }
horovod_key="$horovod_key-$({ env | grep '^HOROVOD_' || true; } | sort | sha256sum | cut -c1-8)"
if ! done_stage horovod "$horovod_key"; then
  cache_root="${PARALLAX_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/parallax/wheels}"
  cached="$cache_root/$horovod_key"
  build="$(mktemp -d)"
  trap 'rm -rf "$build"' EXIT
  gloo_check() { TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c "import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'Horovod was built without gloo'"; }
  install_horovod() { "${pip[@]}" install --force-reinstall "$build"/horovod-*.whl && gloo_check; }
  if [ "${PARALLAX_WHEEL_CACHE:-}" != off ] && cp "$cached"/horovod-*.whl "$build"/ 2>/dev/null; then
    log "installing Horovod 0.28.1 built earlier for this TensorFlow and Python ($cached)"
    if ! install_horovod; then
      log "the kept Horovod wheel does not work here: removing it and building again"
      rm -f "$cached"/horovod-*.whl "$build"/horovod-*.whl
    fi
  fi
  if ! ls "$build"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod 0.28.1 with gloo against TensorFlow (about 4 minutes on 2 cores)"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
      HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      "${pip[@]}" wheel --no-deps --no-build-isolation --no-cache-dir -w "$build" horovod==0.28.1
    install_horovod
    if [ "${PARALLAX_WHEEL_CACHE:-}" != off ]; then  # best effort: a cache we cannot write is no error
      wheel="$(basename "$build"/horovod-*.whl)"
      { mkdir -p "$cached" && cp "$build/$wheel" "$cached/.$wheel.$$" \
          && mv "$cached/.$wheel.$$" "$cached/$wheel"; } 2>/dev/null \
        || log "note: could not keep the Horovod wheel in $cached (it is rebuilt next time)"
    fi
  fi
  mark_stage horovod "$horovod_key"
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
