// Rows in and out of a shard: gathering a pull's rows into the answer (in the table's
// float32, or narrowed to float16/bfloat16 with the overflow check), writing an update's
// rows back (scatter), and the checks of a
// request's ids and rows (range, ownership, finiteness). The GIL is released for the loops.
#include "server_kernels.h"

#include <algorithm>
#include <vector>

namespace parallax_server {

namespace {

enum Wire : int { kFloat32 = 0, kFloat16 = 1, kBfloat16 = 2 };

// Every row in [0, held), the rows of the shard's [held, dim] storage.
void check_rows(int64_t held, const In<int64_t>& rows) {
  const int64_t* r = rows.data();
  for (ssize_t i = 0; i < rows.shape(0); ++i) {
    if (r[i] < 0 || r[i] >= held) {
      throw std::out_of_range("row " + std::to_string(r[i]) + " is outside the shard's " +
                              std::to_string(held) + " rows");
    }
  }
}

// values[rows] into out (of `wire`): -1, or the flat position of the first finite value that
// the wire dtype would make infinite (the caller then refuses the pull, as numpy's path does).
int64_t gather(const In<float>& values, const In<int64_t>& rows, py::array out, int wire) {
  if (values.ndim() != 2 || rows.ndim() != 1) throw std::invalid_argument("gather: shapes");
  const ssize_t n = rows.shape(0), dim = values.shape(1);
  if (out.size() != n * dim) throw std::invalid_argument("gather: out has the wrong size");
  check_rows(values.shape(0), rows);
  void* target = writable(out, wire == kFloat32 ? 4 : 2, "gather's out");
  const float* src = values.data();
  const int64_t* r = rows.data();
  int64_t overflow = -1;
  {
    MaybeReleased released(n * dim * 6);
    for (ssize_t i = 0; i < n; ++i) {
      const float* row = src + r[i] * dim;
      prefetch_ahead(src, r, i, n, dim);
      if (wire == kFloat32) {
        std::memcpy(static_cast<float*>(target) + i * dim, row, dim * sizeof(float));
        continue;
      }
      uint16_t* half = static_cast<uint16_t*>(target) + i * dim;
      const float limit = wire == kBfloat16 ? kBf16OverflowsAt : kF16OverflowsAt;
      for (ssize_t j = 0; j < dim; ++j) {
        half[j] = wire == kBfloat16 ? bf16_bits(row[j]) : f16_bits(row[j]);
        if (overflow < 0 && std::fabs(row[j]) >= limit && std::isfinite(row[j])) {
          overflow = i * dim + j;
        }
      }
    }
  }
  return overflow;
}

// rows' new values into values[rows] (float32 [R, dim] storage, written in place).
void scatter(py::array values, const In<int64_t>& rows, const In<float>& rows_values) {
  if (values.ndim() != 2 || rows.ndim() != 1 || rows_values.ndim() != 2 ||
      rows_values.shape(0) != rows.shape(0) || rows_values.shape(1) != values.shape(1)) {
    throw std::invalid_argument("scatter: values [R, dim], rows [n], rows_values [n, dim]");
  }
  float* dst = static_cast<float*>(writable(values, 4, "scatter's values"));
  if (!values.dtype().is(py::dtype::of<float>())) {
    throw std::invalid_argument("scatter's values must be float32");
  }
  const ssize_t n = rows.shape(0), dim = values.shape(1);
  check_rows(values.shape(0), rows);
  const int64_t* r = rows.data();
  const float* src = rows_values.data();
  // The GIL stays held, as numpy's assignment held it: a reader of the table that does not
  // take the shard's lock never sees a request's rows half-written.
  for (ssize_t i = 0; i < n; ++i) {
    prefetch_ahead<1>(dst, r, i, n, dim);
    std::memcpy(dst + r[i] * dim, src + i * dim, dim * sizeof(float));
  }
}

template <typename T>
bool all_finite_of(const T* data, ssize_t size) {
  bool finite = true;
  MaybeReleased released(size * static_cast<ssize_t>(sizeof(T)));
  for (ssize_t i = 0; i < size; ++i) finite &= std::isfinite(data[i]);
  return finite;
}

// Whether every value is finite (float32 or float64 arrays).
bool all_finite(py::array values) {
  if (!(values.flags() & py::array::c_style)) throw std::invalid_argument("not contiguous");
  if (values.dtype().is(py::dtype::of<float>())) {
    return all_finite_of(static_cast<const float*>(values.data()), values.size());
  }
  if (values.dtype().is(py::dtype::of<double>())) {
    return all_finite_of(static_cast<const double*>(values.data()), values.size());
  }
  throw std::invalid_argument("all_finite takes float32 or float64 arrays");
}

// The first position whose id is outside [0, vocab) or (shard_count > 1) not owned by `shard`
// under the fixed-vocabulary partition (`range`: blocks of `block` ids, else id % shards); -1
// when every id is this shard's. The caller reruns its own check for the message.
int64_t first_foreign(const In<int64_t>& ids, int64_t vocab, int64_t shard_count,
                      int64_t shard, bool range, int64_t block) {
  const int64_t* p = ids.data();
  const ssize_t n = ids.size();
  MaybeReleased released(n * 8);
  for (ssize_t i = 0; i < n; ++i) {
    const int64_t id = p[i];
    if (id < 0 || id >= vocab) return i;
    if (shard_count > 1 && (range ? id / block : id % shard_count) != shard) return i;
  }
  return -1;
}

}  // namespace

void register_rows(py::module_& m) {
  m.def("gather", &gather, py::arg("values"), py::arg("rows"), py::arg("out"),
        py::arg("wire"),
        "values[rows] into out (0 float32, 1 float16, 2 bfloat16 bits); the first float16 "
        "overflow's flat position, or -1");
  m.def("scatter", &scatter, py::arg("values"), py::arg("rows"), py::arg("rows_values"),
        "rows_values into values[rows] in place (float32); a repeated row gets its last");
  m.def("all_finite", &all_finite, py::arg("values"));
  m.def("first_foreign", &first_foreign, py::arg("ids"), py::arg("vocab"),
        py::arg("shard_count"), py::arg("shard"), py::arg("range"), py::arg("block"));
}

}  // namespace parallax_server
