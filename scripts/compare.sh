#!/usr/bin/env bash
# The dated comparison of docs/benchmarks.md (`make compare`; root, about 45 minutes on 2
# cores): parallax's hybrid against Horovod and TensorFlow's ParameterServerStrategy on
# emulated 1 Gbit/s links, with every process held to a quarter core (links scaled to
# 250 Mbit/s with it) at 2 and 4 workers, and on shared cores at 4 workers; plus hybrid against
# parallax's own all-reduce mode at one worker. Each part alternates its systems round by
# round; the parts are merged into OUT/results.json and one report (with the projection,
# fitted to the CPU-isolated points). Add `--workers 1,2,4` or `--workloads lm,ctr,dense`
# to a part for a fuller matrix (about 3 hours).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-results/compare}"
bench=(.venv/bin/parallax bench --networks 1gbit --rounds 2)
"${bench[@]}" --workloads lm,ctr --systems hybrid,allreduce --workers 1 --out "$out/one-worker"
"${bench[@]}" --workloads lm,ctr --systems hybrid,horovod,tf_ps --workers 4 --out "$out/shared"
"${bench[@]}" --workloads lm,ctr --systems hybrid,horovod,tf_ps --workers 2,4 --cpu-share 0.25 \
  --out "$out/isolated"
.venv/bin/python -m parallax.bench.merge "$out" "$out/one-worker" "$out/shared" "$out/isolated"
