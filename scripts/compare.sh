#!/usr/bin/env bash
# The dated comparison of docs/benchmarks.md (`make compare`; root, about an hour on 2 cores):
# parallax's hybrid against Horovod and TensorFlow's ParameterServerStrategy on emulated
# 1 Gbit/s links, on shared cores and with every process held to a quarter core (links
# scaled to 250 Mbit/s with it), plus hybrid against parallax's own all-reduce mode at one
# worker and the dense workload over three rounds. Each part alternates its systems round by
# round; the parts are merged into OUT/results.json and one report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-results/compare}"
bench=(.venv/bin/parallax bench --networks 1gbit --rounds 2)
"${bench[@]}" --workloads lm,ctr --systems hybrid,horovod,tf_ps --workers 1,2,4 \
  --out "$out/shared"
"${bench[@]}" --workloads lm,ctr --systems hybrid,allreduce --workers 1 --out "$out/one-worker"
"${bench[@]}" --workloads lm,ctr --systems hybrid,horovod,tf_ps --workers 4 --cpu-share 0.25 \
  --out "$out/isolated"
"${bench[@]}" --workloads dense --systems hybrid,horovod --workers 4 --rounds 3 \
  --out "$out/dense"
.venv/bin/python -m parallax.bench.merge "$out" "$out/shared" "$out/one-worker" \
  "$out/isolated" "$out/dense"
