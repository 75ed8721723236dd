#!/usr/bin/env bash
# The wheel as a user gets it (issue 14): from a copy of the tracked files, runs the commands of
# the README's "Installing into your own environment" as written there, in a fresh venv: builds
# the wheel, checks what it carries, installs it with the [tf] extra (no Horovod: the quick start
# is one worker and the 2 servers the demo starts), then, from a directory outside the source
# tree, runs `parallax --version`, `parallax demo` (2 workers: without Horovod they sum their
# dense gradients with TensorFlow's collectives) and `parallax demo --workers 1`, which must
# exit 0 with a falling loss. Called by .ci/run and `make wheel-check`. pip's cache is used as usual (no
# --no-cache-dir): where TensorFlow came from PyPI before, it is not downloaded again.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3.11}"
work=""  # made once the checks below pass
started=$SECONDS

log() { printf '[wheel-check +%ds] %s\n' "$((SECONDS - started))" "$*"; }
fail() {
  printf '[wheel-check] FAILED: %s\n' "$*" >&2
  [ -z "$work" ] || printf '[wheel-check] (its files are kept for a look: %s)\n' "$work" >&2
  trap - EXIT
  exit 1
}

# The README's install commands, run below exactly as written there (from the directory that
# holds the clone, ./parallax). A change to either side must be made to both.
build_cmd='pip wheel --no-deps -w dist ./parallax'
install_cmd='pip install "$(ls dist/parallax_tf-*.whl)[tf]" -c parallax/requirements/base.txt'
version_cmd='parallax --version'
demo_cmd='parallax demo --workers 1'
for cmd in "$build_cmd" "$install_cmd" "$version_cmd" "$demo_cmd"; do
  grep -qF -- "$cmd" "$root/README.md" \
    || fail "README.md's install section does not say \`$cmd\`: this script runs the README's commands; change both together"
done

# What the run needs from the machine, said before anything slow starts.
command -v "$python" >/dev/null 2>&1 \
  || fail "$python not found: the check makes its venv with it; install it or set PYTHON=python3.X (3.10-3.12)"
"$python" -c 'import sys, venv, ensurepip; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null \
  || fail "$python is not a Python 3.10-3.12 with venv and ensurepip (TensorFlow 2.17.1 needs 3.10-3.12; Debian: apt-get install python3.11-venv)"
[ -f /usr/share/wordnet/data.noun ] \
  || fail "/usr/share/wordnet is missing: the quick start trains on WordNet's glosses; install Debian's wordnet-base (apt-get install wordnet-base, as root; make env does it)"
command -v git >/dev/null 2>&1 || fail "git not found: the wheel is built from the files git tracks"

# A copy of the tracked files, as a clean clone has them: an untracked file lying in this
# checkout cannot make up for one missing from git, and the build's build/ and *.egg-info stay
# out of the checkout (other people work in it).
work="$(mktemp -d "${TMPDIR:-/tmp}/parallax-wheel-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log "copying the tracked files to $work/parallax"
mkdir -p "$work/parallax" "$work/run"
(cd "$root" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$work/parallax" \
  || fail "could not copy the tracked files (a tracked file deleted in the working tree? see git status)"

log "creating a fresh venv with $python"
"$python" -m venv "$work/venv" || fail "$python -m venv failed"
export PATH="$work/venv/bin:$PATH" PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH PYTHONHOME
cd "$work"

log "$build_cmd"
eval "$build_cmd" || fail "building the wheel failed (pip's output above); pyproject.toml and setup.cfg define it"
wheels=(dist/parallax_tf-*.whl)
# the compiled kernels (parallax.native) make it a wheel for this interpreter and platform
[ ${#wheels[@]} = 1 ] && [[ "${wheels[0]}" == *-cp3*-cp3*-linux_*.whl ]] \
  || fail "expected one wheel dist/parallax_tf-*-cp3X-cp3X-linux_*.whl (with the compiled kernels), got: $(ls dist)"
wheel="$work/${wheels[0]}"
log "built ${wheels[0]} ($(du -k "$wheel" | cut -f1) KiB)"

# Every tracked module of the packages must be in the wheel (setup.cfg lists packages by hand:
# a new subpackage left out of it would only fail on a user's machine), with the typing marker,
# the generated protobuf code, the examples the demo runs, the license and the command.
log "checking the wheel's contents"
(cd "$root" && git ls-files parallax servers/parallax_ps examples) >"$work/tracked.txt"
python - "$wheel" "$work/tracked.txt" <<'EOF' \
  || fail "the wheel lacks what a user needs (listed above): see setup.cfg's packages, package_dir and package_data"
import re, sys, zipfile

wheel = zipfile.ZipFile(sys.argv[1])
names = set(wheel.namelist())
expected = {"parallax/ps/v1/ps_pb2.py", "parallax/ps/v1/ps_pb2_grpc.py", "parallax/py.typed",
            "parallax_ps/__main__.py", "parallax/examples/language_model.py",
            "parallax/examples/common.py"}
if not any(re.fullmatch(r"parallax/native/_kernels\.cpython-3\d+-[^/]+\.so", n) for n in names):
    print("[wheel-check]   missing: parallax/native/_kernels*.so (the compiled kernels: setup.py "
          "builds them with a C++ compiler and pybind11)", file=sys.stderr)
    sys.exit(1)
for path in open(sys.argv[2]).read().split():
    if path.startswith("parallax/") and re.search(r"(\.pyi?|/py\.typed)$", path):
        expected.add(path)
    elif path.startswith("servers/parallax_ps/") and path.endswith(".py"):
        expected.add(path[len("servers/"):])
    elif re.fullmatch(r"examples/[^/]+\.py", path):  # not benchmarks/ nor migration/
        expected.add("parallax/" + path)
problems = [f"missing: {name}" for name in sorted(expected - names)]
info = {n.split("/", 1)[1]: n for n in names if n.split("/")[0].endswith(".dist-info")}
if "LICENSE" not in info and "licenses/LICENSE" not in info:
    problems.append("missing: *.dist-info/LICENSE")
if not re.search(r"^parallax = parallax\.cli:main$",
                 wheel.read(info["entry_points.txt"]).decode(), re.M):
    problems.append("missing: the console script parallax = parallax.cli:main")
metadata = wheel.read(info["METADATA"]).decode()
if not re.search(r"^License-Expression: Apache-2\.0$", metadata, re.M):
    problems.append("METADATA has no License-Expression: Apache-2.0 (setup.py; setuptools >= 77)")
description = metadata.split("\n\n", 1)[-1]
relative = re.findall(r"\]\((?!https?://|mailto:|#)[^)]+\)", description)
if "# parallax" not in description or relative:
    problems.append(f"the long description (the README) is missing or links into the source "
                    f"tree, which an index page cannot follow: {relative[:3]}")
tops = sorted({n.split("/")[0] for n in names} - {n.split("/")[0] for n in info.values()})
if tops != ["parallax", "parallax_ps"]:
    problems.append(f"top-level entries {tops}, expected parallax and parallax_ps only")
for problem in problems:
    print(f"[wheel-check]   {problem}", file=sys.stderr)
if not problems:
    print(f"[wheel-check] {len(names)} files in the wheel, the {len(expected)} expected among "
          f"them (every tracked module, the protobuf code, py.typed, the examples), LICENSE, "
          f"the parallax command")
sys.exit(1 if problems else 0)
EOF

log "$install_cmd"
eval "$install_cmd" || fail "installing the wheel with [tf] failed (pip's output above)"

# From outside the source tree: the venv must import parallax from its own site-packages.
cd "$work/run"
TF_CPP_MIN_LOG_LEVEL=2 python - "$work/venv" <<'EOF' || fail "the fresh venv does not import parallax from the wheel (above)"
import importlib.util, pathlib, sys
import parallax, parallax_ps
for module in (parallax, parallax_ps):
    where = pathlib.Path(module.__file__).resolve()
    assert pathlib.Path(sys.argv[1]).resolve() in where.parents, f"{module.__name__} from {where}"
assert hasattr(parallax, "ParallaxStrategy"), "another project's `parallax` is installed"
assert importlib.util.find_spec("horovod") is None, "Horovod is installed: the check is for none"
from parallax import native
assert native.kernels() is not None, f"the wheel's compiled kernels do not load: {native.describe()}"
EOF

log "$version_cmd"
version="$(eval "$version_cmd")" || fail "parallax --version failed"
log "  $version"
wheel_version="$(basename "$wheel" | cut -d- -f2)"
[[ "$version" == "parallax $wheel_version "* ]] \
  || fail "parallax --version says '$version', the wheel is $wheel_version"

# Without Horovod the demo's default (2 workers) trains on TensorFlow's collectives, as
# `parallax run` chooses there, and says so on its first line. Two short epochs show that
# and a falling loss (8.40 -> 6.36), all the check below asks: the default 3 x 100 steps
# took as long as the quick start itself (113 s against 54 s on 2 busy cores).
two_workers_cmd='parallax demo --epochs 2 -- --steps-per-epoch 25'
log "$two_workers_cmd (2 workers, no Horovod: TensorFlow's collectives)"
eval "$two_workers_cmd" >"$work/two-workers.log" 2>&1 \
  || fail "parallax demo (2 workers) without Horovod failed: $(tail -20 "$work/two-workers.log")"
head -1 "$work/two-workers.log" | grep -qF "summed by TensorFlow's collectives" \
  || fail "parallax demo (2 workers) without Horovod did not name TensorFlow's collectives: $(head -1 "$work/two-workers.log")"

log "$demo_cmd"
set +e
eval "$demo_cmd" 2>&1 | tee "$work/demo.log"
status=${PIPESTATUS[0]}
set -e
[ "$status" = 0 ] || fail "\`$demo_cmd\` exited $status (its output above)"
python - "$work/demo.log" "$work/two-workers.log" <<'EOF' || fail "\`parallax demo\` (1 or 2 workers) did not train (output above, $work/two-workers.log)"
import json, sys
for path in sys.argv[1:]:
    results = [line.split("RESULT ", 1)[1] for line in open(path) if "RESULT {" in line]
    assert results, f"no RESULT line in {path}"
    losses = [epoch["loss"] for epoch in json.loads(results[-1])["epochs"]]
    print(f"[wheel-check] {path}: loss per epoch: {' -> '.join(f'{x:.3f}' for x in losses)}")
    assert len(losses) >= 2 and losses[-1] < losses[0], f"the loss did not fall: {losses}"
EOF
log "ok: the wheel installs and trains the quick start ($((SECONDS - started)) s)"
