"""numpy <-> wire `Tensor` conversion: raw little-endian bytes plus dtype and shape.

numpy has no bfloat16: a BFLOAT16 tensor is read as (and written from) the uint16 array of
its bits; `parallax.protocol.wire_dtypes` converts those to and from float32.

Decoding returns a read-only view on the message's bytes (no copy); encoding makes the one
copy protobuf needs. Malformed tensors raise `WireError` naming the field and the mismatch.
"""
from __future__ import annotations

import math

import numpy as np

from parallax.errors import ParallaxError
from parallax.ps.v1 import ps_pb2

_TO_NUMPY = {
    ps_pb2.FLOAT32: np.dtype("<f4"),
    ps_pb2.FLOAT64: np.dtype("<f8"),
    ps_pb2.FLOAT16: np.dtype("<f2"),
    ps_pb2.INT32: np.dtype("<i4"),
    ps_pb2.INT64: np.dtype("<i8"),
    ps_pb2.BFLOAT16: np.dtype("<u2"),  # its bits
}
_FROM_NUMPY = {dt.newbyteorder("="): code for code, dt in _TO_NUMPY.items()}
_NAMES = {"float32": ps_pb2.FLOAT32, "float64": ps_pb2.FLOAT64, "float16": ps_pb2.FLOAT16,
          "int32": ps_pb2.INT32, "int64": ps_pb2.INT64, "bfloat16": ps_pb2.BFLOAT16}
_NAME_OF = {code: name for name, code in _NAMES.items()}


class WireError(ParallaxError, ValueError):
    """A tensor on the wire is malformed (unknown dtype, shape and byte length disagree)."""


def dtype_code(dtype: object) -> int:
    """The wire code of a numpy dtype or dtype name ('float32', np.float32, ...)."""
    code = _FROM_NUMPY.get(dtype) if isinstance(dtype, np.dtype) else _NAMES.get(dtype)
    if code is not None:  # a native-order dtype (every table's): no conversion needed
        return code
    dt = np.dtype(dtype).newbyteorder("=")
    if dt not in _FROM_NUMPY:
        raise WireError(f"dtype {np.dtype(dtype).name} cannot travel; use one of {sorted(_NAMES)}")
    return _FROM_NUMPY[dt]


def numpy_dtype(code: int) -> np.dtype:
    """The little-endian numpy dtype of a wire dtype code."""
    if code not in _TO_NUMPY:
        name = ps_pb2.DType.Name(code) if code in ps_pb2.DType.values() else str(code)
        raise WireError(f"dtype {name} is not a tensor dtype; use one of {sorted(_NAMES)}")
    return _TO_NUMPY[code]


def dtype_name(code: int) -> str:
    """'float32', ..., 'bfloat16' (whose numpy array is uint16)."""
    numpy_dtype(code)  # raises for an unknown or unset code
    return _NAME_OF[code]


def encode(array: np.ndarray, out: ps_pb2.Tensor | None = None) -> ps_pb2.Tensor:
    """Fill (or create) a wire Tensor from an array; one copy into the message."""
    arr = np.asarray(array)
    wire_dtype = _TO_NUMPY[dtype_code(arr.dtype)]
    arr = np.ascontiguousarray(arr, dtype=wire_dtype)
    tensor = ps_pb2.Tensor() if out is None else out
    tensor.dtype = _FROM_NUMPY[wire_dtype.newbyteorder("=")]
    del tensor.shape[:]
    tensor.shape.extend(arr.shape)
    tensor.content = arr.tobytes()
    return tensor


def decode(tensor: ps_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    """A read-only array viewing the tensor's bytes; validates dtype, shape and length."""
    dtype = numpy_dtype(tensor.dtype) if tensor.dtype else None
    if dtype is None:
        raise WireError(f"{field}: dtype is unset; set it to one of {sorted(_NAMES)}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"{field}: negative dimension in shape {_shown(shape)}")
    count = math.prod(shape)  # Python ints: a huge shape cannot overflow into a match
    expected = count * dtype.itemsize
    if len(tensor.content) != expected:
        needs = expected if expected < _SHOWN_BYTES else f"over {_SHOWN_BYTES}"
        raise WireError(f"{field}: shape {_shown(shape)} of {dtype.name} needs {needs} bytes, "
                        f"got {len(tensor.content)}")
    try:  # a zero-sized shape with huge other dimensions passes the length check
        return np.frombuffer(tensor.content, dtype=dtype, count=count).reshape(shape)
    except ValueError as err:
        raise WireError(f"{field}: shape {_shown(shape)} of {dtype.name} cannot be laid out "
                        f"({err}); send dimensions below 2**31") from None


_SHOWN_BYTES = 1 << 64  # a larger size is said as "over" it (a huge shape's product has
_SHOWN_DIMS = 8         # thousands of digits, past what Python converts to text)


def _shown(shape: tuple) -> str:
    """A shape for a message: its first dimensions when it has many."""
    if len(shape) <= _SHOWN_DIMS:
        return str(list(shape))
    return str(list(shape[:_SHOWN_DIMS]))[:-1] + f", ... ({len(shape)} dimensions)]"
