"""Which data path runs: the compiled kernels (parallax.native) or pure Python, chosen by
PARALLAX_NATIVE. The make env build must have compiled them (CI runs both paths)."""
from __future__ import annotations

import pytest

from parallax import native
from parallax.env import NATIVE_ENV
from parallax.errors import ConfigError


def test_the_development_environment_built_the_compiled_kernels(monkeypatch):
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    module = native.kernels()
    assert module is not None, native.describe()
    assert module.ABI == native.ABI
    assert native.describe().startswith("native")


def test_zero_selects_pure_python(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert native.kernels() is None
    assert native.describe() == "python (selected)"


@pytest.mark.parametrize("value", ["yes", "2", "native"])
def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch, value):
    monkeypatch.setenv(NATIVE_ENV, value)
    with pytest.raises(ConfigError, match=rf"{NATIVE_ENV}=.*auto, 1, 0"):
        native.kernels()


def test_required_but_missing_says_how_to_build(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "1")
    monkeypatch.setattr(native, "_load", lambda: (None, "not built (no module)"))
    with pytest.raises(ConfigError, match="not built.*make env"):
        native.kernels()
