#!/usr/bin/env bash
# The dated comparison of docs/benchmarks.md (`make compare`; root, about 70 minutes on 2
# cores): parallax's hybrid against Horovod and TensorFlow's ParameterServerStrategy.
# Equal hardware is the headline: every system on the same W hosts (servers and TF's
# coordinator inside worker hosts: `--placement colocated`, the default), each host held to a
# quarter core with its 1 Gbit/s link scaled to 250 Mbit/s (`--link-profile core`), at 2 and 4
# workers. Then, at 4 workers: the servers on hosts of their own (`--placement dedicated`,
# the second table, with its extra hosts and cores); the network-heavier ratio of the
# Parallax paper's GPU workers (`--link-profile paper`, 167 Mbit/s per core); shared cores;
# and hybrid against parallax's own all-reduce mode at one worker. Each part alternates its
# systems round by round; the parts are merged, headline first, into OUT/results.json and one
# report (with the projection, fitted to the CPU-isolated points at <= 4 workers).
# PARALLAX_COMPARE_EIGHT=1 adds 2, 4 and 8 workers at 0.125 core a host (8 hosts fit 1 core;
# the projection's error at 8 is then held out; about 2 hours more).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-results/compare}"
bench=(.venv/bin/parallax bench --rounds 2 --workloads lm,ctr)
peers=(--systems hybrid,horovod,tf_ps)
"${bench[@]}" "${peers[@]}" --link-profile core --workers 2,4 --cpu-share 0.25 \
  --out "$out/equal"
"${bench[@]}" "${peers[@]}" --link-profile core --workers 4 --cpu-share 0.25 \
  --placement dedicated --out "$out/dedicated"
"${bench[@]}" "${peers[@]}" --link-profile paper --workers 4 --cpu-share 0.25 \
  --out "$out/paper-link"
"${bench[@]}" "${peers[@]}" --networks 1gbit --workers 4 --out "$out/shared"
"${bench[@]}" --systems hybrid,allreduce --networks 1gbit --workers 1 --out "$out/one-worker"
parts=("$out/equal" "$out/dedicated" "$out/paper-link" "$out/shared" "$out/one-worker")
if [[ "${PARALLAX_COMPARE_EIGHT:-0}" == 1 ]]; then
  "${bench[@]}" "${peers[@]}" --link-profile core --workers 2,4,8 --cpu-share 0.125 \
    --out "$out/eight"
  parts+=("$out/eight")
fi
.venv/bin/python -m parallax.bench.merge "$out" "${parts[@]}"
