"""Every `parallax` command's --help: the whole description, and help text for every option
(fast tier: argparse only, no servers)."""
from __future__ import annotations

import contextlib
import io
import re

import pytest

from parallax.cli import COMMANDS


def _help_of(name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        COMMANDS[name][0](["--help"])
    assert done.value.code == 0
    return out.getvalue()


def _options_without_help(text: str) -> list[str]:
    """Option lines of argparse's help with nothing after the option and no indented line
    below it."""
    lines = text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not re.match(r"^  -", line):
            continue
        explained = re.search(r"\S\s{2,}\S", line.strip()) or \
            (i + 1 < len(lines) and re.match(r"^\s{20,}\S", lines[i + 1]))
        if not explained:
            bare.append(line.strip())
    return bare


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "version"])
def test_every_option_has_help(name):
    assert not _options_without_help(_help_of(name))


def test_the_demo_help_is_not_cut_mid_sentence():
    text = _help_of("demo")
    assert "Extra arguments after `--` go to the example." in text


def test_the_demo_finds_its_example_in_a_source_checkout():
    """A reviewer's finding: after the layout moved demo.py into parallax/launch/, the demo
    looked for examples/ beside the wrong package and `parallax demo` failed in a checkout."""
    from parallax.launch import demo
    assert demo.EXAMPLE.is_file(), demo.PLACES
    assert demo.EXAMPLE.parent in demo.PLACES


def test_python_dash_m_parallax_is_the_command(monkeypatch, capsys):
    """`python -m parallax --version` (no `parallax` script on PATH) runs the command."""
    import runpy
    import sys
    monkeypatch.setattr(sys, "argv", ["parallax", "--version"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("parallax", run_name="__main__")
    assert done.value.code == 0
    assert re.match(r"parallax \S+ \(wire protocol parallax\.ps\.v\d+\)", capsys.readouterr().out)
