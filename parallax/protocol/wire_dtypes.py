"""Compressed rows on the wire: float32 rows sent as float16 or bfloat16 (`TableSpec.wire_dtype`).

The servers keep float32 masters; only what travels is narrowed. One entry per wire dtype in
`WIRE_DTYPES` (name -> `WireDType`: its wire code, the numpy array that carries it, its
encoder and decoder). numpy has no bfloat16: a bfloat16 travels as the uint16 holding its
bits (the upper half of a float32, rounded to nearest even), so on the wire an array of
uint16 *is* bfloat16 (`parallax.protocol.wire`), and decoding shifts the bits back up.
float16 is encoded by uint32/float32 arithmetic on views, the bits of numpy's cast without
its cost (~100 ns for each value that underflows, as most gradients do), and decoded by a
table of all 65,536 values.

Encoding never turns a finite value into an infinity silently: `encode_checked` raises
`WireOverflowError` naming the table, the value and the fix (bfloat16 has float32's range).
No dependency beyond numpy; the servers use this module too (no TensorFlow).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from parallax.errors import ConfigError, ParallaxError
from parallax.ps.v1 import ps_pb2

_F32 = np.dtype("<f4")
_BF16_BITS = np.dtype("<u2")
_EXPONENT_BF16 = 0x7F80  # exponent bits of a bfloat16: all set = Inf or NaN
_QUIET_BF16 = 0x0040     # the quiet bit a NaN keeps (truncating could leave an Inf pattern)


class WireOverflowError(ParallaxError, ValueError):
    """A finite value is beyond the wire dtype's range: sending it would make it infinite."""


def _f32(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=_F32)


def bf16_encode(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest, ties to even; NaN stays a
    (quiet) NaN of the same sign, Inf stays Inf, subnormals round like any other value, and a
    value past bfloat16's largest finite (3.3895e38) by half a unit or more becomes Inf."""
    src = _f32(values)
    bits = src.view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = bits + (lsb + 0x7FFF).astype(np.uint32)  # wraps only for NaN, replaced below
    rounded >>= 16
    nan = np.isnan(src)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | _QUIET_BF16
    if out is None:
        return rounded.astype(_BF16_BITS)
    out[...] = rounded
    return out


def bf16_decode(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exact (the bits become a float32's upper half)."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    if out is None:
        return wide.view(_F32)
    out[...] = wide.view(_F32)
    return out


def bf16_finite(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits) & _EXPONENT_BF16) != _EXPONENT_BF16


_ABS = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)        # also the exponent mask
_F16_INF_AT = np.uint32(0x477FF000)     # 65520: it and everything larger make float16 Inf
_F16_ZERO_AT = np.uint32(97 << 23)      # 2^-30: it and everything smaller make float16 zero
_F16_NORMAL_EXP = np.uint32(113 << 23)  # 2^-14, float16's smallest normal
_REBIAS = np.uint32(15 << 23)           # float16's exponent bias, in a float32's exponent


def _f16_rounded(mag: np.ndarray) -> np.ndarray:
    """float16 bits (in uint32, no sign) of float32 magnitudes (bits, clamped to [2^-30,
    65520]), in place in `mag`: adding 2^(e+15-127) to 4|x|, for |x|'s exponent e (at least
    float16's smallest normal's), leaves 4|x| rounded to nearest even at float16's precision,
    subnormals included, as the sum's low bits (the method of Maratyszcza's FP16 library).
    Branch-free: every value takes the same arithmetic."""
    scaled = np.multiply(mag.view(_F32), np.float32(4.0))
    mag &= _F32_INF
    np.maximum(mag, _F16_NORMAL_EXP, out=mag)
    mag += _REBIAS
    total = mag.view(_F32)
    total += scaled
    exponent = scaled.view(np.uint32)  # reused: `scaled` is spent
    np.right_shift(mag, 13, out=exponent)
    exponent &= np.uint32(0x7C00)
    mag &= np.uint32(0x0FFF)
    mag += exponent
    return mag


def _f16_nan(bits: np.ndarray, half: np.ndarray) -> None:
    """NaN stays a quiet NaN with the upper bits of its payload (as F16C's conversion)."""
    nan = (bits & _ABS) > _F32_INF
    half[nan] = 0x7E00 | ((bits[nan] >> 13) & 0x3FF)


def f16_encode(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> float16, rounded to nearest, ties to even, subnormals included; a value
    past 65504 by half a unit (65520) or more becomes Inf, Inf stays Inf, NaN stays a quiet
    NaN of the same sign. Bit for bit numpy's cast on every non-NaN value, but in uint32
    and float32 arithmetic: numpy's own cast takes ~100 ns for each value that underflows
    (it raises the floating-point underflow flag for each one), as most gradients do."""
    bits = _f32(values).reshape(-1).view(np.uint32)
    half = np.bitwise_and(bits, _ABS)
    has_nan = half.max(initial=0) > _F32_INF
    # clamped: values below 2^-25 round to zero anyway, and no float32 subnormal then
    # meets the arithmetic (each costs a microcode assist, ~4x slower)
    np.clip(half, _F16_ZERO_AT, _F16_INF_AT, out=half)
    _f16_rounded(half)
    if has_nan:
        _f16_nan(bits, half)
    half |= (bits >> 16) & np.uint32(0x8000)
    shape = np.shape(values)
    if out is None:
        return half.astype(np.uint16).view(np.float16).reshape(shape)
    np.copyto(out.view(np.uint16), half.reshape(shape), casting="unsafe")
    return out


_F16_TABLE: list[np.ndarray] = []  # float32 of every float16 bit pattern (256 KiB), on use


def f16_decode(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 -> float32, exact: a lookup of the bits (numpy's own float16 conversion is
    not vectorised, about 2x slower). mode="clip" skips take's bounds check, which every
    uint16 passes (the table has an entry for each)."""
    if not _F16_TABLE:
        _F16_TABLE.append(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(_F32))
    bits = np.ascontiguousarray(values, dtype="<f2").view(np.uint16)
    return np.take(_F16_TABLE[0], bits, out=out, mode="clip")


def _same(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        return values
    out[...] = values
    return out


@dataclass(frozen=True)
class WireDType:
    """How rows of a float32 table travel: `storage` is the numpy array on the wire."""

    name: str
    code: int                # ps_pb2.DType
    storage: np.dtype
    largest: float           # the largest finite value
    overflows_at: float      # the smallest magnitude that rounds to Inf (a float32)
    encode: Callable         # (float32 values, out=None) -> storage array
    decode: Callable         # (storage array, out=None) -> float32 array
    finite: Callable         # storage array -> bool mask

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire."""
        return self.storage.itemsize


WIRE_DTYPES: dict[str, WireDType] = {
    "float32": WireDType("float32", ps_pb2.FLOAT32, _F32, float(np.finfo(np.float32).max),
                         float("inf"), _same, _same, np.isfinite),
    # 65520 = 65504 + half a unit (2^4 / 2): rounds to even, up, to Inf
    "float16": WireDType("float16", ps_pb2.FLOAT16, np.dtype("<f2"), 65504.0, 65520.0,
                         f16_encode, f16_decode, np.isfinite),
    # 2^128 - 2^119: bfloat16's largest (2^128 - 2^120) plus half a unit
    "bfloat16": WireDType("bfloat16", ps_pb2.BFLOAT16, _BF16_BITS, 3.3895313892515355e38,
                          2.0 ** 128 - 2.0 ** 119, bf16_encode, bf16_decode, bf16_finite),
}
COMPRESSED = ("float16", "bfloat16")  # the wire dtypes narrower than a float32 table's rows
_BY_STORAGE = {w.storage: w for w in WIRE_DTYPES.values()}


def get(name: str) -> WireDType:
    """The wire dtype called `name`; ConfigError naming the value and the allowed ones."""
    if name not in WIRE_DTYPES:
        raise ConfigError(f"wire_dtype {name!r} is not supported; use one of "
                          f"{sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def of_array(values: np.ndarray) -> WireDType | None:
    """The wire dtype an array on the wire carries (uint16: bfloat16), or None (float64...)."""
    return _BY_STORAGE.get(np.dtype(values.dtype).newbyteorder("<")) \
        if values.dtype.kind in "fu" else None


def to_float32(values: np.ndarray) -> np.ndarray:
    """Rows as they arrived (float32, float16 or bfloat16 bits) as float32; float32 rows and
    rows of other dtypes are returned as they are."""
    kind = of_array(values)
    return values if kind is None or kind.name == "float32" else kind.decode(values)


def first_overflow(values: np.ndarray, wire: WireDType) -> int | None:
    """The flat position of the first finite value that `wire` would make infinite, or None
    (checked on the float32 values: float16's own arithmetic is slow in numpy)."""
    big = np.abs(values) >= np.float32(wire.overflows_at)
    if not big.any():
        return None
    grown = big & np.isfinite(values)
    return int(np.argmax(grown)) if grown.any() else None


def encode_checked(values: np.ndarray, wire: WireDType, table: str, what: str,
                   out: np.ndarray | None = None) -> np.ndarray:
    """`values` (float32) in `wire`'s storage; WireOverflowError if a finite value would not
    stay finite (`what`: 'gradient', 'row', for the message)."""
    bad = first_overflow(values, wire)
    if bad is not None:
        value = float(np.asarray(values).reshape(-1)[bad])
        hint = ("use wire_dtype='bfloat16' (float32's range in 2 bytes) or 'float32' for it"
                if wire.name == "float16" else "use wire_dtype='float32' for it")
        raise WireOverflowError(
            f"table {table!r}: {what} value {value:g} is beyond {wire.name}'s largest "
            f"{wire.largest:g} and would travel as Inf; {hint}, or clip the values")
    return wire.encode(values, out)
