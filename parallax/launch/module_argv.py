"""`python -m MODULE` for parallax's own modules, without the working directory on sys.path.

`-m` puts the working directory first on the child's sys.path: a job started where the
user's project has a numpy/ (or parallax/) directory had its children import that one and
die at start. `own_module` runs the module as -m would, with the directory this parallax was
imported from in the working directory's place, or, where sys.path has that directory
already (an installed parallax's site-packages), with the working directory just left out
(first, site-packages would come before the standard library). The same argv serves another
host (`hosts serve`, `hosts gpus` over ssh): there the directory may not exist, and that
host's sys.path finds its parallax.
"""
from __future__ import annotations

import sys
from pathlib import Path

RUN_MODULE = ("import os, runpy, sys; root = sys.argv[1]; "
              "sys.path[0:1] = [] if root in map(os.path.realpath, sys.path[1:]) else [root]; "
              "sys.argv[:] = sys.argv[2:]; "
              "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")

ROOT = str(Path(__file__).resolve().parents[2])  # (parallax/launch/ is 0-1)


def own_module(module: str, flags: tuple[str, ...] = ()) -> list[str]:
    """The argv that runs `module` as `python [flags] -m module` would, but from the same
    parallax as this process's and with the working directory off its sys.path."""
    return [sys.executable, *flags, "-c", RUN_MODULE, ROOT, module]
