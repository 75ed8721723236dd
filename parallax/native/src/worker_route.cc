// Routing of every table's ids at once (parallax.protocol.routing.Runs' flat routing): ids
// grouped by (table, shard), sorted by id within each shard, and where equal ids start.
#include <algorithm>
#include <stdexcept>

#include "worker_kernels.h"

namespace parallax_worker {
namespace {

struct Key {
  int64_t shard, id, pos;
  bool operator<(const Key& o) const {
    if (shard != o.shard) return shard < o.shard;
    if (id != o.id) return id < o.id;
    return pos < o.pos;
  }
};

struct Flat {
  std::vector<int64_t> order, unique, first, bounds;
};

int bit_length(uint64_t v) {
  int bits = 0;
  while (v) ++bits, v >>= 1;
  return bits;
}

// Rows j = 0..n-1 of a table's ids in sorted (shard, id, position) order into `flat`:
// the order, where each (shard, id) run starts, where each shard starts.
template <typename Shard, typename Id, typename Pos>
void emit(size_t n, int64_t lo, int64_t shards, Shard shard, Id id, Pos pos, Flat* flat) {
  size_t u_lo = flat->unique.size();
  for (size_t j = 0; j < n; ++j) {
    flat->order[lo + j] = pos(j);
    if (j == 0 || id(j) != id(j - 1) || shard(j) != shard(j - 1)) {
      flat->unique.push_back(id(j));
      flat->first.push_back(lo + static_cast<int64_t>(j));
    }
  }
  size_t u = u_lo;  // where each shard's unique ids start (and where the last ends)
  for (int64_t s = 0; s <= shards; ++s) {
    while (u < flat->unique.size() && shard(static_cast<size_t>(flat->first[u] - lo)) < s) ++u;
    flat->bounds.push_back(static_cast<int64_t>(u));
  }
}

// One table's ids sorted by (shard, id, position) into `flat`: as one packed uint64 each
// when shard, id and position fit together (the usual case, as routing.grouped_order
// does; one small array, sorted), else as triples. False if an id routes outside the
// table's shards (an id nobody checked: the numpy path decides then).
bool route_table(const int64_t* ids, const Tables& t, size_t k, std::vector<Key>* keys,
                 std::vector<uint64_t>* packed, Flat* flat) {
  int64_t lo = t.starts[k], hi = t.starts[k + 1], shards = t.shard_counts[k];
  size_t n = static_cast<size_t>(hi - lo);
  int64_t low = 0, high = 0;
  for (int64_t i = lo; i < hi; ++i) low = std::min(low, ids[i]), high = std::max(high, ids[i]);
  int pos_bits = std::max(1, bit_length(n)), id_bits = bit_length(static_cast<uint64_t>(high));
  int shift = id_bits + pos_bits;
  bool pack = low >= 0 && shift + bit_length(static_cast<uint64_t>(shards)) <= 64;
  keys->clear();
  packed->clear();
  for (int64_t i = lo; i < hi; ++i) {
    int64_t shard = shard_of(ids[i], t.kinds[k], shards, t.blocks[k]);
    if (shard < 0 || shard >= shards) return false;
    if (pack)
      packed->push_back((static_cast<uint64_t>(shard) << shift) |
                        (static_cast<uint64_t>(ids[i]) << pos_bits) |
                        static_cast<uint64_t>(i - lo));
    else
      keys->push_back(Key{shard, ids[i], i});
  }
  if (pack) {
    std::sort(packed->begin(), packed->end());
    const uint64_t* v = packed->data();
    uint64_t mask = (uint64_t{1} << pos_bits) - 1;
    emit(n, lo, shards, [=](size_t j) { return static_cast<int64_t>(v[j] >> shift); },
         [=](size_t j) { return ids[lo + static_cast<int64_t>(v[j] & mask)]; },
         [=](size_t j) { return lo + static_cast<int64_t>(v[j] & mask); }, flat);
  } else {
    std::sort(keys->begin(), keys->end());
    const Key* key = keys->data();
    emit(n, lo, shards, [=](size_t j) { return key[j].shard; },
         [=](size_t j) { return key[j].id; }, [=](size_t j) { return key[j].pos; }, flat);
  }
  return true;
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& values) {
  py::array_t<T> out(static_cast<py::ssize_t>(values.size()));
  if (!values.empty()) std::memcpy(out.mutable_data(), values.data(), values.size() * sizeof(T));
  return out;
}

py::object route(Int64s ids, Int64s starts, Int64s shard_counts, Int64s kinds, Int64s blocks) {
  size_t count = static_cast<size_t>(shard_counts.size());
  if (static_cast<size_t>(starts.size()) != count + 1 ||
      static_cast<size_t>(kinds.size()) != count || static_cast<size_t>(blocks.size()) != count)
    throw std::invalid_argument("route: starts must have one entry more than the tables, "
                                "kinds and blocks one per table");
  Tables t{starts.data(), shard_counts.data(), kinds.data(), blocks.data(), count};
  if (t.starts[count] != ids.size())
    throw std::invalid_argument("route: the last start must be the number of ids");
  Flat flat;
  bool ok = true;
  {
    py::gil_scoped_release release;
    flat.order.resize(static_cast<size_t>(ids.size()));
    std::vector<Key> keys;
    std::vector<uint64_t> packed;
    for (size_t k = 0; k < count && ok; ++k)
      ok = route_table(ids.data(), t, k, &keys, &packed, &flat);
  }
  if (!ok) return py::none();
  return py::make_tuple(to_array(flat.order), to_array(flat.unique), to_array(flat.first),
                        to_array(flat.bounds));
}

}  // namespace

void register_route(py::module_& m) {
  m.def("route", &route, py::arg("ids"), py::arg("starts"), py::arg("shard_counts"),
        py::arg("kinds"), py::arg("blocks"),
        "Every table's ids routed at once: (order, unique, first, bounds) as "
        "parallax.protocol.routing.Runs.flat_routing, or None if an id routes outside its "
        "table's shards.");
}

}  // namespace parallax_worker
