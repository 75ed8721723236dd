// Duplicate sums of a push (parallax.protocol.routing.sum_duplicates, and a sync step's
// aggregate of every worker's chunks, divided by the workers for a mean), bit for bit:
// rows in a stable order of id; a run of up to SHORT_RUN rows is added strictly in order,
// a longer one as numpy's np.add.reduceat adds it (its first row, plus numpy's pairwise sum of
// the rest, column by column).
#include "server_kernels.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace parallax_server {

namespace {

constexpr int64_t kShortRun = 8;     // routing.SHORT_RUN
constexpr int64_t kPairwiseBlock = 128;  // numpy's PW_BLOCKSIZE

struct Column {
  const float* const* rows;  // each element's row, in summing order
  ssize_t column;
  float at(ssize_t i) const { return rows[i][column]; }
};

// numpy's FLOAT_pairwise_sum over col[lo, lo + n), for n >= 8 (runs longer than kShortRun):
// its n < 8 branch, whose first accumulator numpy versions start at 0.0 or -0.0, is never
// reached (a split leaves halves of at least 64).
float pairwise(const Column& col, ssize_t lo, ssize_t n) {
  if (n < 8) {
    float res = -0.0f;
    for (ssize_t i = 0; i < n; ++i) res += col.at(lo + i);
    return res;
  }
  if (n <= kPairwiseBlock) {
    float r[8];
    for (int j = 0; j < 8; ++j) r[j] = col.at(lo + j);
    ssize_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += col.at(lo + i + j);
    }
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += col.at(lo + i);
    return res;
  }
  ssize_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise(col, lo, n2) + pairwise(col, lo + n2, n - n2);
}

struct Input {
  std::vector<const int64_t*> ids;
  std::vector<const float*> grads;
  std::vector<ssize_t> counts;
  ssize_t total = 0;
  ssize_t dim = -1;
};

Input inputs(const py::list& ids, const py::list& grads, std::vector<py::object>& keep) {
  if (ids.size() != grads.size() || ids.size() == 0) {
    throw std::invalid_argument("aggregate: one grads array per ids array, at least one");
  }
  Input in;
  for (size_t k = 0; k < ids.size(); ++k) {
    auto i = ids[k].cast<In<int64_t>>();
    auto g = grads[k].cast<In<float>>();
    if (i.ndim() != 1 || g.ndim() != 2 || g.shape(0) != i.shape(0) ||
        (in.dim >= 0 && g.shape(1) != in.dim)) {
      throw std::invalid_argument("aggregate: ids [n] and grads [n, dim] of one dim");
    }
    in.dim = g.shape(1);
    in.ids.push_back(i.data());
    in.grads.push_back(g.data());
    in.counts.push_back(i.shape(0));
    in.total += i.shape(0);
    keep.push_back(i);
    keep.push_back(g);
  }
  return in;
}

// Sum each run of equal ids in `order` ((id, position) pairs sorted) of the rows `src` (by
// position) into summed; unique gets each run's id.
void sum_runs(const std::vector<std::pair<int64_t, int64_t>>& order,
              const std::vector<const float*>& src, ssize_t dim, int64_t* unique,
              float* summed) {
  std::vector<const float*> rows(order.size());
  for (size_t i = 0; i < order.size(); ++i) rows[i] = src[order[i].second];
  ssize_t u = 0;
  for (size_t lo = 0; lo < order.size(); ++u) {
    size_t hi = lo + 1;
    while (hi < order.size() && order[hi].first == order[lo].first) ++hi;
    unique[u] = order[lo].first;
    float* out = summed + u * dim;
    std::memcpy(out, rows[lo], dim * sizeof(float));
    const ssize_t count = static_cast<ssize_t>(hi - lo);
    if (count > kShortRun) {
      for (ssize_t c = 0; c < dim; ++c) {
        out[c] = out[c] + pairwise(Column{rows.data(), c}, lo + 1, count - 1);
      }
    } else {
      for (size_t k = lo + 1; k < hi; ++k) {
        for (ssize_t c = 0; c < dim; ++c) out[c] += rows[k][c];
      }
    }
    lo = hi;
  }
}

// Sort (id, position) pairs, the same order as a stable sort by id (positions differ): each
// chunk's pairs merged into those before it when every chunk is in order already.
void in_order(std::vector<std::pair<int64_t, int64_t>>& order,
              const std::vector<ssize_t>& counts, bool chunks_sorted) {
  if (!chunks_sorted) {
    std::sort(order.begin(), order.end());
    return;
  }
  ssize_t done = 0;
  for (ssize_t count : counts) {
    std::inplace_merge(order.begin(), order.begin() + done, order.begin() + done + count);
    done += count;
  }
}

// (sorted unique ids, per-id sums [/ divisor]) of the chunks' rows, concatenated in order.
py::tuple aggregate(const py::list& ids, const py::list& grads, float divisor) {
  std::vector<py::object> keep;
  Input in = inputs(ids, grads, keep);
  const ssize_t dim = in.dim;
  std::vector<const float*> src(in.total);
  std::vector<std::pair<int64_t, int64_t>> order(in.total);
  ssize_t unique_count = 0;
  {
    MaybeReleased released(in.total * 16);
    ssize_t at = 0;
    bool chunks_sorted = true;  // each chunk's ids in order (what clients send)
    for (size_t k = 0; k < in.ids.size(); ++k) {
      for (ssize_t i = 0; i < in.counts[k]; ++i, ++at) {
        order[at] = {in.ids[k][i], at};
        src[at] = in.grads[k] + i * dim;
        chunks_sorted = chunks_sorted && (i == 0 || in.ids[k][i] >= in.ids[k][i - 1]);
      }
    }
    in_order(order, in.counts, chunks_sorted);
    for (size_t i = 0; i < order.size(); ++i) {
      unique_count += (i == 0 || order[i].first != order[i - 1].first);
    }
  }
  py::array_t<int64_t> unique(unique_count);
  py::array_t<float> summed({unique_count, dim});
  int64_t* u = unique.mutable_data();
  float* s = summed.mutable_data();
  {
    MaybeReleased released(in.total * dim * 4 * 2);
    sum_runs(order, src, dim, u, s);
    if (divisor > 0.0f) {
      for (ssize_t i = 0; i < unique_count * dim; ++i) s[i] = s[i] / divisor;
    }
  }
  return py::make_tuple(unique, summed);
}

}  // namespace

void register_sums(py::module_& m) {
  m.def("aggregate", &aggregate, py::arg("ids"), py::arg("grads"), py::arg("divisor"),
        "(sorted unique ids, summed rows [/ divisor when > 0]) of float32 chunks, as "
        "routing.sum_duplicates sums their concatenation");
}

}  // namespace parallax_server
