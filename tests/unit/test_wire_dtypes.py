"""Compressed rows on the wire (parallax.protocol.wire_dtypes), fast tier: no servers.

bfloat16 rounding against ml_dtypes (TensorFlow's own bfloat16, a reference only: parallax
does not depend on it) over every upper half and the lower halves around each rounding
boundary, and against a float64 reference; float16 against numpy's cast over every sign,
exponent and float16 mantissa with the dropped bits on and around each tie (subnormals, Inf
and NaN included); overflow refused; the table spec, both codecs and the plan carrying a
wire dtype."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.errors import ConfigError
from parallax.placement.plan import PlacementOptions, VariableInfo, make_plan
from parallax.tf.strategy.config import StrategyConfig
from parallax.protocol import bulk_codec, packed_codec, wire, wire_dtypes
from parallax.protocol.specs import TableSpec
from parallax.protocol.wire_dtypes import WireOverflowError, bf16_decode, bf16_encode

ml_dtypes = pytest.importorskip("ml_dtypes")
LOWER_HALVES = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000]


def _every_upper_half() -> np.ndarray:
    """float32s with every possible upper half and lower halves on and around a tie."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = (upper[:, None] | np.array(LOWER_HALVES, np.uint32)[None, :]).reshape(-1)
    return bits.view(np.float32)


def _reference(values: np.ndarray) -> np.ndarray:
    """Round to nearest even in float64: the two bfloat16 neighbours by truncation."""
    out = []
    for v in values:
        bits = int(np.float32(v).view(np.uint32))
        down = bits >> 16
        if np.isinf(v):
            out.append(down)
            continue
        lo = np.float64(np.uint32(down << 16).view(np.float32))
        hi = np.float64(np.uint32(((down + 1) & 0xFFFF) << 16).view(np.float32))
        below, above = abs(float(v) - lo), abs(hi - float(v))  # magnitudes: signs alike
        if not np.isfinite(hi) and np.isfinite(lo):  # past the largest: compare to 2^128
            above = 2.0 ** 128 - abs(float(v))
        pick = down + 1 if above < below or (above == below and down & 1) else down
        out.append(pick)
    return np.array(out, np.uint16)


def test_bf16_rounds_as_ml_dtypes_on_every_upper_half():
    values = _every_upper_half()
    got = bf16_encode(values)
    with np.errstate(invalid="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(got[finite], want[finite])
    nan = np.isnan(values)  # NaN stays NaN with its sign (payloads may differ)
    assert np.isnan(bf16_decode(got[nan])).all()
    np.testing.assert_array_equal(got[nan] >> 15, want[nan] >> 15)
    np.testing.assert_array_equal(got[np.isinf(values)], want[np.isinf(values)])


@pytest.mark.parametrize("value, expected", [
    (1.0 + 2 ** -8, 0x3F80),             # a tie, even below: stays
    (1.0 + 3 * 2 ** -8, 0x3F82),         # a tie, odd below: goes up
    (1.0 + 2 ** -8 + 2 ** -20, 0x3F81),  # just past a tie: up
    (np.float32(1.4e-45), 0x0000),       # smallest subnormal: rounds to +0
    (np.float32(2.0 ** -126 - 2.0 ** -149), 0x0080),  # top subnormal up to the smallest normal
    (-0.0, 0x8000),
    (float("inf"), 0x7F80), (float("-inf"), 0xFF80),
    (3.4e38, 0x7F80),                    # beyond bfloat16's largest by more than half a unit
])
def test_bf16_ties_subnormals_and_limits(value, expected):
    values = np.array([value], np.float32)
    assert int(bf16_encode(values)[0]) == expected
    assert int(_reference(values)[0]) == expected


def test_bf16_matches_the_float64_reference_on_random_values():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[np.isfinite(values)]
    np.testing.assert_array_equal(bf16_encode(values), _reference(values))


def test_bf16_decode_is_exact_and_nan_stays_quiet_nan():
    every = np.arange(1 << 16, dtype=np.uint16)
    wide = bf16_decode(every)
    finite = np.isfinite(wide)
    np.testing.assert_array_equal(bf16_encode(wide)[finite], every[finite])
    signalling = np.array([0x7F800001], np.uint32).view(np.float32)  # would truncate to Inf
    assert np.isnan(bf16_decode(bf16_encode(signalling))).all()


F16_DROPPED_BITS = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x0ABC]  # a tie is 0x1000


def _every_f16_prefix() -> np.ndarray:
    """float32 bits with every upper 19 bits (sign, exponent, float16's 10 mantissa bits)
    and the 13 bits a normal float16 drops on and around a tie; a subnormal's tie lies in
    the upper bits, so its neighbours are here too."""
    upper = np.arange(1 << 19, dtype=np.uint32) << 13
    return (upper[:, None] | np.array(F16_DROPPED_BITS, np.uint32)[None, :]).reshape(-1)


def test_f16_encode_is_numpys_cast_bit_for_bit_and_nan_stays_quiet_nan():
    bits = _every_f16_prefix()
    values = bits.view(np.float32)
    with np.errstate(all="ignore"):  # numpy flags each underflow and overflow
        want = values.astype(np.float16).view(np.uint16)
    got = wire_dtypes.f16_encode(values).view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7E00) == 0x7E00).all()  # a quiet NaN: no NaN becomes an Inf
    np.testing.assert_array_equal(got[nan] & 0x8000, (bits[nan] >> 16) & 0x8000)


def test_f16_encode_keeps_the_shape_and_fills_out():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
    out = np.empty((4, 3), np.float16)
    assert wire_dtypes.f16_encode(rows, out) is out
    np.testing.assert_array_equal(out, rows.astype(np.float16))
    assert wire_dtypes.f16_encode(np.float32(65519.0)).shape == ()
    assert float(wire_dtypes.f16_encode(np.float32(65519.0))) == 65504.0
    assert wire_dtypes.f16_encode(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_f16_rounds_as_numpy_and_decodes_exactly():
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(5000) * 1000).astype(np.float32)
    narrow = wire_dtypes.get("float16").encode(values)
    np.testing.assert_array_equal(narrow, values.astype(np.float16))
    np.testing.assert_array_equal(wire_dtypes.get("float16").decode(narrow),
                                  narrow.astype(np.float32))


@pytest.mark.parametrize("name, value", [("float16", 65520.0), ("float16", -1e6),
                                         ("bfloat16", 3.4e38)])
def test_a_finite_value_that_would_travel_as_inf_is_refused(name, value):
    values = np.array([[0.5, value]], np.float32)
    with pytest.raises(WireOverflowError, match=rf"table 't'.*{name}.*Inf") as err:
        wire_dtypes.encode_checked(values, wire_dtypes.get(name), "t", "gradient")
    assert ("wire_dtype='bfloat16'" in str(err.value)) == (name == "float16")
    inf = np.array([np.inf, np.nan, 65504.0], np.float32)  # already Inf/NaN, or in range
    wire_dtypes.encode_checked(inf, wire_dtypes.get("float16"), "t", "row")


def test_table_spec_carries_its_wire_dtype_on_the_wire():
    for name in ("float16", "bfloat16"):
        spec = TableSpec(name="t", vocabulary_size=10, dim=2, wire_dtype=name)
        assert TableSpec.from_proto(spec.to_proto()) == spec and spec.row_wire_dtype == name
    same = TableSpec(name="t", vocabulary_size=10, dim=2, wire_dtype="float32")
    assert same == TableSpec(name="t", vocabulary_size=10, dim=2) and same.to_proto().wire_dtype == 0
    with pytest.raises(ConfigError, match=r"wire_dtype 'int8' is not supported.*bfloat16"):
        TableSpec(name="t", vocabulary_size=10, dim=2, wire_dtype="int8")
    with pytest.raises(ConfigError, match=r"needs dtype 'float32', got 'float64'"):
        TableSpec(name="t", vocabulary_size=10, dim=2, dtype="float64", wire_dtype="float16")
    assert wire.dtype_name(ps_code := wire.dtype_code(np.uint16)) == "bfloat16"
    assert wire.numpy_dtype(ps_code) == np.dtype("<u2")


@pytest.mark.parametrize("dtype", [np.float16, np.uint16, np.float32])
def test_both_codecs_carry_narrow_rows(dtype):
    rows = (np.arange(12, dtype=np.float32).reshape(4, 3) / 7)
    narrow = rows.astype(dtype) if dtype != np.uint16 else bf16_encode(rows)
    writer = packed_codec.PullManyAnswerWriter([(4, 3, narrow.dtype, 5), (0, 3, np.float32, 5)])
    writer.values[0][...] = narrow
    (got, step), (empty, _) = packed_codec.decode_pull_many_answer(writer.data())
    assert got.dtype == narrow.dtype and step == 5 and empty.shape == (0, 3)
    np.testing.assert_array_equal(got, narrow)
    writer = bulk_codec.PullResponseWriter(4, 3, narrow.dtype, 2)
    writer.values[...] = narrow
    got, _ = bulk_codec.decode_pull_response(writer.data())
    np.testing.assert_array_equal(got, narrow)
    np.testing.assert_allclose(wire_dtypes.to_float32(got), rows, rtol=1e-2)
    push = bulk_codec.decode_push_request(bulk_codec.encode_push_request(
        "t", 0, 1, 0, np.arange(4), narrow))
    assert push.grads.dtype == narrow.dtype
    np.testing.assert_array_equal(push.grads, narrow)


# ---- the plan ------------------------------------------------------------------------------
def _table(index: int, dtype: str = "float32") -> VariableInfo:
    return VariableInfo(index, f"table_{index}", (100, 8), dtype, True, "gather on axis 0",
                        "IndexedSlices")


def _plan(infos, keys=None, **config):
    return make_plan(PlacementOptions(**config), infos, run_id="r", num_servers=1,
                     num_workers=1, group_keys=keys)


def test_strategy_config_refuses_unknown_wire_dtypes_naming_the_allowed():
    with pytest.raises(ConfigError, match=r"wire_dtype is 'fp8'; use one of float32, float16"):
        StrategyConfig(wire_dtype="fp8")
    with pytest.raises(ConfigError, match=r"wire_dtype of 'a' is 'half'"):
        StrategyConfig(wire_dtype={"a": "half"})


def test_plan_gives_float32_tables_the_wire_dtype_and_shows_it():
    plan = _plan([_table(0), _table(1, "float64")], wire_dtype="bfloat16")
    assert [v.wire_dtype for v in plan.variables] == ["bfloat16", ""]
    head, first, second = plan.format().splitlines()[1:4]
    assert "wire" in head and "bfloat16" in first and "  -  " in second
    assert "wire" not in _plan([_table(0)]).format()
    assert "wire" not in _plan([_table(0)], wire_dtype="float32").format()
    named = _plan([_table(0), _table(1)], wire_dtype={"table_1": "float16"})
    assert [v.wire_dtype for v in named.variables] == ["", "float16"]


def test_plan_refuses_wire_dtypes_it_cannot_apply():
    with pytest.raises(ConfigError, match=r"wire_dtype names \['nope'\] match no trainable"):
        _plan([_table(0)], wire_dtype={"nope": "float16"})
    with pytest.raises(ConfigError, match=r"'table_0', which the plan keeps on the workers"):
        _plan([_table(0)], wire_dtype={"table_0": "float16"}, mode="allreduce")
    with pytest.raises(ConfigError, match=r"the variable is float64"):
        _plan([_table(0, "float64")], wire_dtype={"table_0": "float16"})


def test_tables_with_different_wire_dtypes_never_share_a_group():
    infos = [_table(i) for i in range(4)]
    keys = {i: "stream" for i in range(4)}
    plan = _plan(infos, keys, wire_dtype={"table_0": "bfloat16", "table_1": "bfloat16"})
    tables = [v.table for v in plan.variables]
    assert tables[0] == tables[1] and tables[2] == tables[3] and tables[0] != tables[2]
    assert [v.wire_dtype for v in plan.variables] == ["bfloat16", "bfloat16", "", ""]
