// A shard's rows when first touched: the "uniform" initializer of
// parallax.protocol.initial_values, element by element as its numpy code computes it, so the
// values are bit-identical (float64 arithmetic, rounded once to the table's dtype).
#include "hash64.h"
#include "server_kernels.h"

namespace parallax_server {

namespace {

using parallax_hash::mix64;

constexpr uint64_t kRowStride = 0xD6E8FEB86659FD93ULL;  // initial_values._ROW_STRIDE
constexpr double kUnit = 1.0 / 9007199254740992.0;      // 1 / 2^53

// Uniform [minval, maxval) values of the rows with these global ids (or keys) into the
// [n, dim] float32 or float64 `out`: u = (mix64(row + 2 j) >> 11) 2^-53 with row =
// mix64(id * kRowStride ^ mix64(seed)), then minval + (maxval - minval) u, in float64.
void init_uniform(uint64_t seed, const In<int64_t>& ids, int64_t dim, double minval,
                  double maxval, py::array out) {
  if (ids.ndim() != 1 || dim < 0) throw std::invalid_argument("init_uniform: shapes");
  const ssize_t n = ids.shape(0);
  if (out.ndim() != 2 || out.shape(0) != n || out.shape(1) != dim) {
    throw std::invalid_argument("init_uniform: out must be [len(ids), dim]");
  }
  const bool wide = out.itemsize() == 8;
  void* target = writable(out, wide ? 8 : 4, "init_uniform's out");
  if (!py::isinstance<py::array_t<float>>(out) && !py::isinstance<py::array_t<double>>(out)) {
    throw std::invalid_argument("init_uniform's out must be float32 or float64");
  }
  const uint64_t key = mix64(seed);
  const double span = maxval - minval;
  const int64_t* id = ids.data();
  MaybeReleased released(n * dim * (wide ? 8 : 4));
  for (ssize_t i = 0; i < n; ++i) {
    const uint64_t row = mix64((static_cast<uint64_t>(id[i]) * kRowStride) ^ key);
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t bits = mix64(row + static_cast<uint64_t>(j) * 2u) >> 11;
      const double u = static_cast<double>(bits) * kUnit;
      const double value = minval + span * u;
      if (wide) {
        static_cast<double*>(target)[i * dim + j] = value;
      } else {
        static_cast<float*>(target)[i * dim + j] = static_cast<float>(value);
      }
    }
  }
}

}  // namespace

void register_init(py::module_& m) {
  m.def("init_uniform", &init_uniform, py::arg("seed"), py::arg("ids"), py::arg("dim"),
        py::arg("minval"), py::arg("maxval"), py::arg("out"),
        "initial_values' uniform rows of `ids` into out ([n, dim] float32 or float64)");
}

}  // namespace parallax_server
