// The members of a table group merged into their server table's ids
// (parallax.client.step._table_ids): each member's ids checked against its own rows,
// offset to where its rows start, and joined in member order.
#include <stdexcept>

#include "worker_kernels.h"

namespace parallax_worker {
namespace {

py::tuple join_ids(py::list ids, Int64s limits, Int64s offsets) {
  size_t count = static_cast<size_t>(ids.size());
  if (static_cast<size_t>(limits.size()) != count || static_cast<size_t>(offsets.size()) != count)
    throw std::invalid_argument("join_ids: one limit and one offset a member, got " +
                                std::to_string(limits.size()) + " and " +
                                std::to_string(offsets.size()) + " for " +
                                std::to_string(count) + " members");
  std::vector<Int64s> held;
  size_t total = 0;
  for (size_t m = 0; m < count; ++m) {
    held.push_back(ids[m].cast<Int64s>());
    total += static_cast<size_t>(held.back().size());
  }
  py::array_t<int64_t> joined(static_cast<py::ssize_t>(total));
  int64_t* out = joined.mutable_data();
  int64_t bad = -1;
  {
    py::gil_scoped_release release;
    for (size_t m = 0; m < count; ++m) {  // all of it: the caller decides what a bad id is
      const int64_t* in = held[m].data();
      int64_t n = held[m].size(), limit = limits.data()[m], offset = offsets.data()[m];
      for (int64_t i = 0; i < n; ++i) {
        if (bad < 0 && (in[i] < 0 || in[i] >= limit)) bad = static_cast<int64_t>(m);
        out[i] = in[i] + offset;
      }
      out += n;
    }
  }
  return py::make_tuple(joined, bad);
}

}  // namespace

void register_merge(py::module_& m) {
  m.def("join_ids", &join_ids, py::arg("ids"), py::arg("limits"), py::arg("offsets"),
        "A table group's ids: every member's ids plus its offset, joined in order, and the "
        "first member with an id outside [0, its limit) (-1: none).");
}

}  // namespace parallax_worker
