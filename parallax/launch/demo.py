"""`parallax demo`: the main job. Trains the word-level language model of
examples/language_model.py (WordNet glosses, a 57k-word input table on the servers) on a local
cluster of 2 workers and 2 parameter servers, with progress, loss and perplexity per epoch,
and throughput. Extra arguments after `--` go to the example."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallax.errors import ConfigError
from parallax.launch.backends.horovodrun import horovod_installed
from parallax.launch.run import LaunchConfig, run
from parallax.runtime import logs

# The wheel carries examples/*.py as parallax/examples (setup.cfg maps them there); a source
# checkout (and an editable install) has them beside the package.
_PACKAGE = Path(__file__).resolve().parents[1]  # parallax/
PLACES = (_PACKAGE / "examples", _PACKAGE.parent / "examples")
EXAMPLE = next((place / "language_model.py" for place in PLACES
                if (place / "language_model.py").is_file()), PLACES[0] / "language_model.py")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="parallax demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes, launched by horovodrun (default 2; 1 runs "
                             "without Horovod)")
    parser.add_argument("--servers", type=int, default=2,
                        help="parameter servers started on this machine (default 2)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="passes over the data (default 3)")
    args = logs.parse(parser, argv)
    if not EXAMPLE.exists():
        raise ConfigError(f"the demo's example language_model.py is in neither "
                          f"{PLACES[0]} (where the wheel puts it) nor {PLACES[1]} (a source "
                          f"checkout): reinstall parallax-tf (its wheel carries the examples), "
                          f"or run from a clone with `make demo`")
    print(f"parallax demo: training {EXAMPLE.name} on {_count(args.workers, 'worker')} and "
          f"{_count(args.servers, 'parameter server')}{_collectives(args.workers)}", flush=True)
    command = (sys.executable, str(EXAMPLE), "--epochs", str(args.epochs), *extra)
    return run(LaunchConfig(num_workers=args.workers, num_servers=args.servers,
                            command=command, log_level=args.log_level))


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _collectives(workers: int) -> str:
    """How several workers will sum dense gradients, as `parallax run`'s backends choose
    (`--collectives auto`: Horovod where this Python imports it, else TensorFlow's)."""
    if workers < 2:
        return ""
    if not horovod_installed():
        return " (dense gradients summed by TensorFlow's collectives: Horovod is not installed)"
    return " (dense gradients summed by Horovod)"
