#!/usr/bin/env bash
# `make image`: builds the Dockerfile with podman and smoke-tests the result, on a machine with
# no container registry and no working `podman run` (root, Debian bookworm). Steps:
#   1. podman and debootstrap from apt when missing (as root);
#   2. the base image BASE_IMAGE, when absent: a debootstrap'ed bookworm with python3.11 and
#      its venv module, imported with `podman import` (cached as that image; about 35 s);
#   3. `podman build --isolation chroot --build-arg BASE=...`, pip configured as on this
#      machine: its pip.conf files and PIP_* variables merged into one file, passed as the
#      build secret `pipconf`, the CA bundle they name as the secret `pipca`, the local files
#      and directories they name (constraint files, find-links, file:// indexes) bind-mounted
#      read-only. None of it is stored in the image;
#   4. the smoke test: the image's filesystem (podman create + podman mount) under chroot, as
#      its user, with its environment, working directory and entry point: `parallax
#      --version`, imports of parallax and horovod.tensorflow (gloo), no compiler, sshd or
#      test tools, then a short training (`parallax demo`, SMOKE_WORKERS Horovod workers and
#      one parameter server, a few steps);
#   5. the image's size.
# Environment: IMAGE (localhost/parallax:latest), TARGET (runtime; `ssh` for the ssh stage),
# BASE_IMAGE (localhost/parallax-base:bookworm-py311; set BASE_IMAGE=python:3.11-slim-bookworm
# where a registry is reachable), DEBIAN_MIRROR (http://deb.debian.org/debian), SMOKE_WORKERS
# (2), SKIP_SMOKE=1, FRESH=1 (a build from scratch: removes IMAGE and prunes dangling images,
# the layer cache, first; not --no-cache, which the second pass below cannot take),
# PODMAN_BUILD_ARGS (more `podman build` arguments for both passes).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
image="${IMAGE:-localhost/parallax:latest}"
target="${TARGET:-runtime}"
base="${BASE_IMAGE:-localhost/parallax-base:bookworm-py311}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
smoke_workers="${SMOKE_WORKERS:-2}"

log() { printf '[image] %s\n' "$*"; }
die() { printf '[image] error: %s\n' "$*" >&2; exit 1; }
smoke_inside() {  # in a private mount namespace: chroot into the mounted image and test it
  local root="$SMOKE_ROOT" user workdir entrypoint image_env uid gid home start
  # shellcheck disable=SC1091
  . "$SMOKE_WORK/run.vars"
  mapfile -t image_env <"$SMOKE_WORK/run.env"
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  mount -t tmpfs -o size=1g,mode=1777 shm "$root/dev/shm"
  uid="${user%%:*}"
  read -r uid gid home < <(awk -F: -v u="$uid" '$3 == u || $1 == u {print $3, $4, $6}' "$root/etc/passwd")
  in_image() {  # COMMAND...: what `podman run --entrypoint COMMAND IMAGE` would run
    chroot --userspec="$uid:$gid" "$root" /usr/bin/env -i "${image_env[@]}" \
      HOME="${home:-/}" /bin/sh -c 'cd "$0" && exec "$@"' "$workdir" "$@"
  }
  run_image() { in_image "${entrypoint[@]}" "$@"; }  # ARGS...: `podman run IMAGE ARGS`

  log "smoke test: parallax --version (uid $uid, in $workdir)"
  run_image --version
  log "smoke test: import parallax, horovod.tensorflow"
  in_image python -c "import parallax, horovod, horovod.tensorflow as hvd, tensorflow as tf, keras; \
assert hvd.gloo_built(); print('parallax', parallax.__version__, '| horovod', horovod.__version__, \
'(gloo) | tensorflow', tf.__version__, '| keras', keras.__version__)"
  log "smoke test: no compiler, no test or benchmark tools$([ "$TARGET" = runtime ] && echo ', no sshd')"
  in_image /bin/sh -c '! command -v g++ && ! command -v cc && ! command -v make' >/dev/null \
    || die "a compiler is in the image"
  if [ "$TARGET" = runtime ]; then
    in_image /bin/sh -c '! command -v sshd && [ ! -e /usr/sbin/sshd ]' >/dev/null \
      || die "sshd is in the runtime image"
  fi
  in_image python -c "import importlib.util as u; \
names = ('pytest', 'matplotlib', 'dockerfile_parse', 'kubernetes_validate', 'grpc_tools', 'cmake'); \
found = [m for m in names if u.find_spec(m)]; assert not found, found; print('absent:', *names)"
  log "smoke test: parallax demo --workers $SMOKE_WORKERS --servers 1 --epochs 1 (a few steps)"
  start=$SECONDS
  run_image demo --workers "$SMOKE_WORKERS" --servers 1 --epochs 1 -- \
    --max-sentences 2000 --eval-sentences 200 --steps-per-epoch 5 --batch-size 64
  log "smoke test passed (the training took $((SECONDS - start)) s)"
}
if [ "${1:-}" = --smoke-inside ]; then
  smoke_inside
  exit
fi
[ "$(id -u)" = 0 ] || die "run as root: podman build --isolation chroot, podman mount and chroot need it"

# --------------------------------------------------------------------------- 1. tools
missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
if [ "$base" = localhost/parallax-base:bookworm-py311 ] && ! command -v debootstrap >/dev/null 2>&1; then
  missing+=(debootstrap)
fi
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || die "install ${missing[*]}"
  log "installing ${missing[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" \
    || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; }
fi

work="$(mktemp -d /tmp/parallax-image.XXXXXX)"
chmod 700 "$work"
smoke_cid=""
cleanup() {
  if [ -n "$smoke_cid" ]; then
    podman umount "$smoke_cid" >/dev/null 2>&1 || true
    podman rm -f "$smoke_cid" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# --------------------------------------------------------------------------- 2. base image
if [ "$base" = localhost/parallax-base:bookworm-py311 ] && ! podman image exists "$base"; then
  log "making the base image $base (debootstrap bookworm, python3.11)"
  start=$SECONDS
  rootfs="$work/rootfs"
  debootstrap --variant=minbase \
    --include=python3.11,python3.11-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3.11"]' - "$base" >/dev/null
  rm -rf "$rootfs"
  log "base image ready in $((SECONDS - start)) s"
fi

# --------------------------------------------------------------------------- 3. build
# pip's configuration on this machine, as pip reads it (global, then user files, then
# PIP_CONFIG_FILE, then PIP_* variables), merged into one file for the build: the CA bundle
# it names becomes the secret pipca, local files and directories it names are bind-mounted.
python3 - "$work" <<'EOF'
import configparser, os, sys, urllib.parse
work = sys.argv[1]
home = os.path.expanduser("~")
files = ["/etc/xdg/pip/pip.conf", "/etc/pip.conf", f"{home}/.pip/pip.conf",
         f"{home}/.config/pip/pip.conf"]
if os.environ.get("PIP_CONFIG_FILE") not in (None, "", os.devnull):
    files.append(os.environ["PIP_CONFIG_FILE"])
conf = configparser.ConfigParser(interpolation=None)
conf.read([f for f in files if os.path.isfile(f)])
if not conf.has_section("global"):
    conf.add_section("global")
for key, value in os.environ.items():
    if key.startswith("PIP_") and key != "PIP_CONFIG_FILE":
        conf["global"][key[4:].lower().replace("_", "-")] = value
ca = None
for section in conf.sections():
    if conf.has_option(section, "cert"):
        ca = ca or conf[section]["cert"]
        conf[section]["cert"] = "/run/secrets/pipca"
for var in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
    if not ca and os.path.isfile(os.environ.get(var, "")):
        ca = os.environ[var]
        conf["global"]["cert"] = "/run/secrets/pipca"
# local files and directories the configuration names (constraint files, find-links, file://
# indexes): bind-mounted read-only
mounts = set()
for section in conf.sections():
    for option in conf.options(section):
        if option == "cert":
            continue
        for value in conf[section][option].split():
            path = urllib.parse.urlparse(value).path if value.startswith("file:") else value
            if not path.startswith("/") or not os.path.exists(path):
                continue
            # a file:// index <root>/simple links to files beside it (<root>/files)
            if option.endswith("index-url") and os.path.basename(path.rstrip("/")) == "simple":
                path = os.path.dirname(path.rstrip("/"))
            mounts.add(os.path.realpath(path))
with open(os.path.join(work, "pip.conf"), "w") as out:
    conf.write(out)
with open(os.path.join(work, "pip-ca"), "w") as out:
    out.write(ca if ca and os.path.isfile(ca) else "")
with open(os.path.join(work, "pip-mounts"), "w") as out:
    out.write("".join(f"{m}\n" for m in sorted(mounts)))
EOF
build_args=(--isolation chroot --layers --build-arg "BASE=$base"
            --secret "id=pipconf,src=$work/pip.conf")
ca="$(cat "$work/pip-ca")"
[ -n "$ca" ] && build_args+=(--secret "id=pipca,src=$ca")
# shellcheck disable=SC2206
build_args+=(${PODMAN_BUILD_ARGS:-})
volumes=()
while read -r dir; do
  [ -n "$dir" ] && volumes+=(--volume "$dir:$dir:ro")
done <"$work/pip-mounts"
if [ "${FRESH:-0}" = 1 ]; then
  log "FRESH=1: removing $image and every dangling image (the layer cache)"
  podman rmi -f "$image" >/dev/null 2>&1 || true
  podman image prune -f >/dev/null
fi
# Two passes: the builder stage with the bind mounts pip needs, then the target from the
# layers just cached, without them (a build volume leaves its empty mount point in every
# layer a RUN makes: /opt/pypi and the like would show up in the runtime image).
start=$SECONDS
log "podman build ${build_args[*]} ${volumes[*]} --target deps $root"
podman build "${build_args[@]}" "${volumes[@]}" --target deps "$root"
log "podman build ${build_args[*]} --target $target -t $image $root"
podman build "${build_args[@]}" --target "$target" -t "$image" "$root"
log "built $image (target $target) in $((SECONDS - start)) s"

# --------------------------------------------------------------------------- 4. smoke test
if [ "${SKIP_SMOKE:-0}" != 1 ]; then
  # the image's user, working directory, entry point and environment, as `podman run` would
  # apply them (podman run itself cannot start containers here)
  config="$(podman image inspect --format '{{json .Config}}' "$image")"
  python3 - "$config" "$work" <<'EOF'
import json, shlex, sys
config, work = json.loads(sys.argv[1]), sys.argv[2]
entrypoint = " ".join(shlex.quote(a) for a in config.get("Entrypoint") or [])
with open(f"{work}/run.env", "w") as out:
    out.write("".join(f"{e}\n" for e in config.get("Env") or []))
with open(f"{work}/run.vars", "w") as out:
    out.write(f"user={shlex.quote(config.get('User') or '0')}\n")
    out.write(f"workdir={shlex.quote(config.get('WorkingDir') or '/')}\n")
    out.write(f"entrypoint=({entrypoint})\n")
EOF
  smoke_cid="$(podman create "$image")"
  smoke_root="$(podman mount "$smoke_cid")"
  # the container's /etc/hosts (podman run would write one): localhost and this host's name
  grep -qs '\blocalhost\b' "$smoke_root/etc/hosts" \
    || printf '127.0.0.1 localhost %s\n::1 localhost\n' "$(hostname)" >>"$smoke_root/etc/hosts"
  # /proc, /sys and /dev are mounted in a mount namespace of its own: nothing reaches the host
  # and nothing outlives the test
  SMOKE_ROOT="$smoke_root" SMOKE_WORK="$work" TARGET="$target" SMOKE_WORKERS="$smoke_workers" \
    unshare --mount --propagation private -- bash "${BASH_SOURCE[0]}" --smoke-inside
fi

# --------------------------------------------------------------------------- 5. size
size="$(podman image inspect --format '{{.Size}}' "$image")"
log "image $image: $(numfmt --to=iec-i --suffix=B "$size") ($size bytes), $(podman image inspect --format '{{len .RootFS.Layers}}' "$image") layers"
