"""Build of parallax's compiled kernels (parallax.native._kernels); everything else is in
setup.cfg. The extension is optional: where it cannot be compiled (no C++ compiler, no
pybind11) the wheel and the editable install still work and parallax runs its pure-Python
path (parallax.native says which one runs, and PARALLAX_NATIVE selects it)."""
from __future__ import annotations

import glob
import os
import re

from setuptools import Extension, setup


def _compile_in_parallel() -> None:
    """The kernels' sources compiled side by side, one per core (PARALLAX_BUILD_JOBS caps
    it): pybind11's helper for distutils, which compiles one extension's files in turn."""
    try:
        from pybind11.setup_helpers import ParallelCompile
    except ImportError:
        return
    ParallelCompile("PARALLAX_BUILD_JOBS", default=0).install()


def _include() -> list[str]:
    try:
        import pybind11
    except ImportError:  # the build is optional: setuptools reports it and goes on
        return []
    return [pybind11.get_include()]


# -ffp-contract=off: no fused multiply-add, so every float operation rounds as numpy's does
# (the pure-Python path is the reference: rows, slots and steps must be bit-identical).
KERNELS = Extension(
    "parallax.native._kernels",
    sources=sorted(glob.glob(os.path.join("parallax", "native", "src", "*.cc"))),
    depends=sorted(glob.glob(os.path.join("parallax", "native", "src", "*.h"))),
    include_dirs=_include() + [os.path.join("parallax", "native", "src")],
    language="c++",
    # -g0: no debug information (Python's default -g doubles the compile time)
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math",
                        "-fvisibility=hidden", "-Wall", "-g0"],
    optional=True,
)

_compile_in_parallel()
# A link into the source tree ("[text](docs/x.md)"): the project has no public home whose
# address could make it absolute, so on an index page it names the file instead of breaking.
_RELATIVE_LINK = re.compile(r"!?\[([^\]]+)\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def long_description(readme: str = "README.md") -> str:
    """The README for the package index: its links into the source tree as file names."""
    with open(readme, encoding="utf-8") as f:
        return _RELATIVE_LINK.sub(_as_file_name, f.read())


def _as_file_name(link: re.Match) -> str:
    text, path = link.group(1), link.group(2)
    return f"`{path}`" if text.strip("`") == path else f"{text} (`{path}` in the source)"


# PEP 639's License-Expression (setuptools >= 77; setup.cfg has no key for it)
setup(ext_modules=[KERNELS], license_expression="Apache-2.0",
      long_description=long_description(), long_description_content_type="text/markdown")
