#!/usr/bin/env bash
# The dated comparison of docs/benchmarks.md (`make compare`; root, about 3 hours on 2
# cores): parallax's hybrid against Horovod and TensorFlow's ParameterServerStrategy.
# Equal hardware is the headline: every system on the same W hosts (servers and TF's
# coordinator inside worker hosts: `--placement colocated`, the default), each host held to
# 0.125 core with its 1 Gbit/s link scaled to 125 Mbit/s (`--link-profile core`: one core
# and its NIC, slowed 8x; 8 hosts fit the machine's cores), at 2, 4 and 8 workers (the
# projection is fitted to <= 4 and its error at 8 held out). Then, in the same setting at 4
# workers: the servers on hosts of their own (`--placement dedicated`, the second table, with
# its extra hosts and cores); the network-heavier ratio of the Parallax paper's GPU workers
# (`--link-profile paper`); and one worker (hybrid against parallax's own all-reduce mode
# and Horovod); the dense workload (no embeddings: hybrid is parallax's all-reduce, within 5%
# of Horovod is the bar), 3 rounds. Last, shared cores (no CPU groups). Each part
# alternates its systems round by round; the parts are merged, headline first, into
# OUT/results.json and one report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-bench-results/compare}"
bench=(.venv/bin/parallax bench --rounds 2 --workloads lm,ctr)
peers=(--systems hybrid,horovod,tf_ps)
host=(--cpu-share 0.125)
"${bench[@]}" "${peers[@]}" --link-profile core "${host[@]}" --workers 2,4,8 --out "$out/equal"
"${bench[@]}" "${peers[@]}" --link-profile core "${host[@]}" --workers 4 \
  --placement dedicated --out "$out/dedicated"
"${bench[@]}" "${peers[@]}" --link-profile paper "${host[@]}" --workers 4 \
  --out "$out/paper-link"
"${bench[@]}" --systems hybrid,allreduce,horovod --link-profile core "${host[@]}" \
  --workers 1 --out "$out/one-worker"
.venv/bin/parallax bench --rounds 3 --workloads dense --systems hybrid,horovod \
  --link-profile core "${host[@]}" --workers 4 --out "$out/dense"
"${bench[@]}" "${peers[@]}" --networks 1gbit --workers 4 --out "$out/shared"
.venv/bin/python -m parallax.bench.merge "$out" "$out/equal" "$out/dedicated" \
  "$out/paper-link" "$out/one-worker" "$out/dense" "$out/shared"
