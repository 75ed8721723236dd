"""Issue 32's worker-kill measurement: an N-worker Keras fit (tests/helpers/chaos_worker.py:
Adagrad on a table on 2 co-located servers, a dense layer all-reduced) under `parallax run
--max-restarts 1`, worker rank 1 SIGKILLed at step KILL_AT; printed: the steps redone, the
seconds from the kill to the first step of the restarted workers, and the largest weight
difference from an uninterrupted run of the same job. With --warm-starts on,off and
--rounds R, R rounds alternate the settings (`parallax run --warm-starts`), one line each;
--held-backups 0,4 alternates `parallax run --held-backups` the same way (with --save-freq 1:
a backup every step, one in 4 on disk, the others' tables held by the servers).

    python docs/benchmarks/2026-12-05-elastic/kill_a_worker.py --workers 4 [--save-freq 1]
    python docs/benchmarks/2026-12-05-elastic/kill_a_worker.py --workers 4 --save-freq 1 \
        --warm-starts on,off --rounds 3

Run from the repository root, with `parallax` installed (or PYTHONPATH set to the tree).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "chaos_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")


def _job(tmp: Path, name: str, workers: int, save_freq: int | None, delay: float,
         warm: str = "auto", held: str = "0"):
    command = [PARALLAX, "run", "-np", str(workers), "--servers", "2", "--max-restarts", "1",
               "--restart-delay", "0", "--warm-starts", warm, "--held-backups", held,
               "--data-dir", str(tmp / name / "data"), "--run-id", name, "--", sys.executable,
               str(WORKER), "--interval", "4", "--epochs", "8",
               "--step-delay", str(delay), "--paced-attempts", "1",
               "--backup", str(tmp / name / "backup"), "--out", str(tmp / f"{name}.npz")]
    if save_freq:
        command += ["--save-freq", str(save_freq)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(ROOT), str(ROOT / "servers"), str(ROOT / "tests" / "helpers"),
                                 os.environ.get("PYTHONPATH", "")])})


def _events(lines: list[str]) -> list[dict]:
    """The workers' events; the first of a line that holds two (ranks' output interleaved)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(line[line.index('{"chaos"'):])[0] for line in lines
            if '{"chaos"' in line]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--save-freq", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--warm-starts", default="auto",
                        help="parallax run's --warm-starts, or several, comma-separated, "
                             "alternated in each round")
    parser.add_argument("--held-backups", default="0",
                        help="parallax run's --held-backups, or several, comma-separated, "
                             "alternated in each round")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        full = _job(tmp, "full", args.workers, args.save_freq, 0.0)
        full_out = full.communicate()[0]
        assert full.returncode == 0, full_out[-3000:]
        for round_ in range(args.rounds):
            for warm in args.warm_starts.split(","):
                for held in args.held_backups.split(","):
                    name = f"chaos{round_}{warm}{held}"
                    print(json.dumps({"round": round_, "warm_starts": warm,
                                      "held_backups": int(held),
                                      **_killed_run(tmp, name, args, warm, held)}), flush=True)


def _killed_run(tmp: Path, name: str, args, warm: str, held: str = "0") -> dict:
    """One job with rank 1 killed after step --kill-at; what it cost."""
    job = _job(tmp, name, args.workers, args.save_freq, 0.3, warm, held)
    lines, killed_at = [], None
    for line in job.stdout:
        lines.append(line)
        events = _events(lines[-1:])
        if killed_at is None and events and events[0]["chaos"] == "step" \
                and events[0]["step"] >= args.kill_at:
            victim = next(e for e in _events(lines) if e["chaos"] == "start"
                          and e["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.time()
    assert job.wait() == 0, "".join(lines[-60:])
    events = _events(lines)
    done = max(e["step"] for e in events if e["attempt"] == 0)
    later = [e for e in events if e["attempt"] == 1]
    resumed = min(e["step"] for e in later if e["chaos"] == "start")
    first = min(e["time"] for e in later if e["chaos"] == "step")
    with np.load(tmp / "full.npz") as want, np.load(tmp / f"{name}.npz") as got:
        diff = max(float(np.abs(got[k] - want[k]).max()) for k in want.files)
    return {"workers": args.workers, "save_freq": args.save_freq or "epoch",
            "killed_after_step": done, "resumed_at": resumed,
            "steps_redone": done - resumed,
            "kill_to_first_step_s": round(first - killed_at, 2), "max_weight_diff": diff}


if __name__ == "__main__":
    main()
