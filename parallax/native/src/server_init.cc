// A shard's rows when first touched: the counter-based uniform draws under every random
// initializer of parallax.protocol.initial_values (`_uniform01`), element by element as its
// numpy code computes them, so the rows are bit-identical; numpy then shapes them (the
// uniform range, Box-Muller's log and cos, truncation's redraws) as before.
#include "hash64.h"
#include "server_kernels.h"

#include <utility>

namespace parallax_server {

namespace {

using parallax_hash::mix64;

constexpr uint64_t kRowStride = 0xD6E8FEB86659FD93ULL;    // initial_values._ROW_STRIDE
constexpr uint64_t kRoundStride = 0xA0761D6478BD642FULL;  // initial_values._ROUND_STRIDE
constexpr double kUnit = 1.0 / 9007199254740992.0;        // 1 / 2^53

// The [len(ids), dim] `out` of T (float or double), checked: (its data, len(ids)).
template <typename T>
std::pair<T*, ssize_t> rows_out(const In<int64_t>& ids, int64_t dim, py::array& out,
                               const char* what) {
  const ssize_t n = ids.ndim() == 1 ? ids.shape(0) : -1;
  if (n < 0 || dim < 0 || out.ndim() != 2 || out.shape(0) != n || out.shape(1) != dim ||
      !py::isinstance<py::array_t<T>>(out)) {
    throw std::invalid_argument(std::string(what) + ": out must be a [len(ids), dim] array of "
                                "its dtype");
  }
  return {static_cast<T*>(writable(out, sizeof(T), what)), n};
}

// Calls draw(i, j, u) for every element: u uniform in [0, 1), (mix64(row + 2 j + stream +
// round x kRoundStride) >> 11) / 2^53 with row = mix64(id_i x kRowStride ^ seed_key)
// (wrapping uint64 arithmetic; seed_key = mix64(seed)).
template <typename Draw>
void each_uniform(uint64_t seed_key, const int64_t* id, ssize_t n, int64_t dim,
                  uint64_t stream, uint64_t round, Draw draw) {
  const uint64_t offset = stream + round * kRoundStride;
  for (ssize_t i = 0; i < n; ++i) {
    const uint64_t row = mix64((static_cast<uint64_t>(id[i]) * kRowStride) ^ seed_key);
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t counter = row + static_cast<uint64_t>(j) * 2u + offset;
      draw(i * dim + j, static_cast<double>(mix64(counter) >> 11) * kUnit);
    }
  }
}

// initial_values._uniform01 of one (stream, round) into a float64 `out`.
void uniform01(uint64_t seed_key, const In<int64_t>& ids, int64_t dim, uint64_t stream,
               uint64_t round, py::array out) {
  auto [target, n] = rows_out<double>(ids, dim, out, "uniform01");
  MaybeReleased released(n * dim * 8);
  each_uniform(seed_key, ids.data(), n, dim, stream, round,
               [target](ssize_t k, double u) { target[k] = u; });
}

// A "uniform" initializer's rows into a float32 or float64 `out`: minval + (maxval - minval)
// u in float64, rounded once to out's dtype (initial_values' numpy, without its temporaries).
template <typename T>
void uniform_rows(uint64_t seed_key, const In<int64_t>& ids, int64_t dim, double minval,
                  double maxval, py::array& out) {
  auto [target, n] = rows_out<T>(ids, dim, out, "uniform_rows");
  const double span = maxval - minval;
  MaybeReleased released(n * dim * sizeof(T));
  each_uniform(seed_key, ids.data(), n, dim, 0, 0, [target, minval, span](ssize_t k, double u) {
    target[k] = static_cast<T>(minval + span * u);
  });
}

void uniform_rows_into(uint64_t seed_key, const In<int64_t>& ids, int64_t dim, double minval,
                       double maxval, py::array out) {
  if (out.itemsize() == 8) {
    uniform_rows<double>(seed_key, ids, dim, minval, maxval, out);
  } else {
    uniform_rows<float>(seed_key, ids, dim, minval, maxval, out);
  }
}

}  // namespace

void register_init(py::module_& m) {
  m.def("uniform01", &uniform01, py::arg("seed_key"), py::arg("ids"), py::arg("dim"),
        py::arg("stream"), py::arg("round"), py::arg("out"),
        "initial_values._uniform01 of `ids` into out (a float64 [n, dim] array)");
  m.def("uniform_rows", &uniform_rows_into, py::arg("seed_key"), py::arg("ids"),
        py::arg("dim"), py::arg("minval"), py::arg("maxval"), py::arg("out"),
        "a uniform initializer's rows of `ids` into out ([n, dim] float32 or float64)");
}

}  // namespace parallax_server
