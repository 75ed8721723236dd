"""`python -m parallax.bench.merge OUT PART...`: one results file from several benchmark runs.

A comparison too large for one matrix (`scripts/compare.sh`: equal hardware at 2, 4 and 8
workers, then dedicated servers, another link ratio, one worker and shared cores) runs as
several `parallax bench` commands, each with its own --out. This concatenates their runs
into OUT/results.json (every part's command and notes kept in `meta`) and renders the
report there. Ratios in the
report compare systems within one workload, worker count and network setting, which always
come from a single part, so systems are still measured side by side in alternating rounds.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from parallax.errors import ConfigError


def merge(parts: list[Path]) -> dict:
    """The runs of every part's results.json, in order, under one `meta`."""
    merged: dict = {"meta": {"notes": [], "parts": []}, "runs": []}
    for part in parts:
        path = part / "results.json"
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot merge {path}: {exc}; run its `parallax bench` "
                              f"command first (scripts/compare.sh)") from None
        meta = results.get("meta", {})
        for key in ("date", "commit", "machine"):
            merged["meta"].setdefault(key, meta.get(key))
        merged["meta"]["parts"].append({"dir": part.name, "command": meta.get("command"),
                                        "date": meta.get("date"), "commit": meta.get("commit")})
        merged["meta"]["notes"] += [n for n in meta.get("notes", [])
                                    if n not in merged["meta"]["notes"]]
        merged["runs"] += results.get("runs", [])
    merged["meta"]["command"] = "; ".join(p["command"] or "" for p in merged["meta"]["parts"])
    return merged


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m parallax.bench.merge OUT PART_DIR [PART_DIR ...]",
              file=sys.stderr)
        return 2
    out, parts = Path(args[0]), [Path(a) for a in args[1:]]
    try:
        merged = merge(parts)
    except ConfigError as exc:
        print(f"parallax.bench.merge: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    from parallax.bench.command import main as bench_main
    return bench_main(["--report-only", "--out", str(out)])


if __name__ == "__main__":
    sys.exit(main())
