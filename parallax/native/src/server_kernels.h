// The parameter server's compiled kernels (see servers/parallax_ps/native_path.py): shared
// helpers for server_*.cc. Every kernel reproduces the pure-Python path's float operations
// one by one, in the same order (compiled with -ffp-contract=off: no fused multiply-add), so
// rows, slots and steps are bit-identical between the two paths.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace parallax_server {

namespace py = pybind11;

// A C-contiguous input array of T (read-only views of a request's bytes are fine).
template <typename T>
using In = py::array_t<T, py::array::c_style>;

// The writable storage of an output array of `itemsize`-byte elements: refused (ValueError)
// unless it is C-contiguous and writable, so a kernel never writes into a temporary copy.
inline void* writable(py::array& out, ssize_t itemsize, const char* what) {
  if (!(out.flags() & py::array::c_style) || !out.writeable() || out.itemsize() != itemsize) {
    throw std::invalid_argument(std::string(what) + " must be a writable C-contiguous array of " +
                                std::to_string(itemsize) + "-byte elements");
  }
  return out.mutable_data();
}

// Work on fewer bytes than this keeps the GIL: with other threads waiting for it, giving it
// up and taking it back costs a switch (microseconds, up to the 5 ms switch interval of
// waiting) where the work itself takes a few microseconds.
constexpr ssize_t kReleaseGilBytes = 256 * 1024;

// Releases the GIL for its lifetime when `bytes` of work are worth it.
class MaybeReleased {
 public:
  explicit MaybeReleased(ssize_t bytes) {
    if (bytes >= kReleaseGilBytes) state_ = PyEval_SaveThread();
  }
  ~MaybeReleased() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  MaybeReleased(const MaybeReleased&) = delete;
  MaybeReleased& operator=(const MaybeReleased&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// A shard's rows are read and written at random places of a table far larger than the
// caches: each row costs a cache miss, and a TLB miss, that one at a time would wait for in
// turn. Kernels that walk rows ask for the row kPrefetchAhead places ahead while they copy
// this one, so the misses overlap (`prefetch_row`: its lines, at most kPrefetchLines; the
// hardware follows on past them).
constexpr ssize_t kPrefetchAhead = 8;
constexpr ssize_t kPrefetchLines = 8;
constexpr ssize_t kCacheLine = 64;

template <int Write = 0>
inline void prefetch_row(const void* row, ssize_t bytes) {
  if (bytes <= 0) return;
  const char* at = static_cast<const char*>(row);
  const char* last = at + bytes - 1;
  for (ssize_t line = 0; line < kPrefetchLines && at <= last; ++line, at += kCacheLine) {
    __builtin_prefetch(at, Write);
  }
  __builtin_prefetch(last, Write);  // (an unaligned row's last line)
}

// While row i of `rows` is copied: ask for row i + kPrefetchAhead of the [R, dim] `table`.
template <int Write = 0>
inline void prefetch_ahead(const float* table, const int64_t* rows, ssize_t i, ssize_t n,
                           ssize_t dim) {
  if (i + kPrefetchAhead < n) {
    prefetch_row<Write>(table + rows[i + kPrefetchAhead] * dim, dim * sizeof(float));
  }
}

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// float32 -> bfloat16 bits, as wire_dtypes.bf16_encode: round to nearest even; a NaN keeps its
// upper bits with the quiet bit set.
inline uint16_t bf16_bits(float value) {
  uint32_t bits = bits_of(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

// float32 -> float16 bits, as wire_dtypes.f16_encode (numpy's cast on every non-NaN value):
// round to nearest even, subnormals included, Inf at 65520 and beyond; a NaN stays a quiet NaN
// with the upper bits of its payload.
inline uint16_t f16_bits(float value) {
  uint32_t bits = bits_of(value);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((bits >> 13) & 0x3FFu));
  if (mag >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // Inf (or rounds to)
  if (mag < 0x38800000u) {  // below 2^-14: a float16 subnormal (or zero)
    if (mag < 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to zero
    uint32_t exponent = mag >> 23;
    uint32_t mantissa = (mag & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exponent;  // value / 2^-24 (float16's subnormal unit)
    uint32_t half = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1u);
    uint32_t midway = 1u << (shift - 1u);
    if (rest > midway || (rest == midway && (half & 1u))) half += 1u;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((mag >> 13) - (112u << 10));  // rebias the exponent: 127 - 15
  uint32_t rest = mag & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1u;
  return static_cast<uint16_t>(sign | half);
}

// The smallest float32 magnitude each wire dtype turns into Inf (wire_dtypes.WireDType).
constexpr float kF16OverflowsAt = 65520.0f;
constexpr float kBf16OverflowsAt = 3.3961775e38f;  // 2^128 - 2^119

// numpy's float32 maximum (its SIMD loop): NaN wins (the first one), else the larger, and the
// second operand when they compare equal (+0 against -0).
inline float np_maximum(float a, float b) {
  if (std::isnan(a)) return a;
  if (std::isnan(b)) return b;
  return a > b ? a : b;
}

// numpy's sign: -1, 0 or 1; NaN stays as it is.
inline float np_sign(float x) {
  if (x > 0.0f) return 1.0f;
  if (x < 0.0f) return -1.0f;
  if (x == 0.0f) return 0.0f;
  return x;
}

// Adds every server kernel to the module (module.cc calls it).
void register_server(py::module_& m);
void register_rows(py::module_& m);
void register_sums(py::module_& m);
void register_optimizers(py::module_& m);
void register_init(py::module_& m);

}  // namespace parallax_server
