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

// keys sorted by (shard, id, position): as one packed uint64 each when shard, id and
// position fit together (the usual case, as routing.grouped_order does), else as triples.
void sort_keys(std::vector<Key>* keys, int64_t shards, std::vector<uint64_t>* packed) {
  int64_t low = 0, high = 0;
  for (const Key& k : *keys) low = std::min(low, k.id), high = std::max(high, k.id);
  int pos_bits = std::max(1, bit_length(keys->size())), id_bits = bit_length(high);
  int shard_bits = bit_length(static_cast<uint64_t>(shards));
  if (low < 0 || pos_bits + id_bits + shard_bits > 64) {
    std::sort(keys->begin(), keys->end());
    return;
  }
  packed->clear();
  for (size_t i = 0; i < keys->size(); ++i) {
    const Key& k = (*keys)[i];
    packed->push_back((static_cast<uint64_t>(k.shard) << (id_bits + pos_bits)) |
                      (static_cast<uint64_t>(k.id) << pos_bits) | i);
  }
  std::sort(packed->begin(), packed->end());
  std::vector<Key> sorted;
  sorted.reserve(keys->size());
  uint64_t mask = (uint64_t{1} << pos_bits) - 1;
  for (uint64_t v : *packed) sorted.push_back((*keys)[v & mask]);
  keys->swap(sorted);
}

// One table's ids sorted by (shard, id, position) into `flat`; false if an id routes
// outside the table's shards (an id nobody checked: the numpy path decides then).
bool route_table(const int64_t* ids, const Tables& t, size_t k, std::vector<Key>* keys,
                 Flat* flat) {
  int64_t lo = t.starts[k], hi = t.starts[k + 1], shards = t.shard_counts[k];
  keys->clear();
  for (int64_t i = lo; i < hi; ++i) {
    int64_t shard = shard_of(ids[i], t.kinds[k], shards, t.blocks[k]);
    if (shard < 0 || shard >= shards) return false;
    keys->push_back(Key{shard, ids[i], i});
  }
  std::vector<uint64_t> packed;
  sort_keys(keys, shards, &packed);
  int64_t u_lo = static_cast<int64_t>(flat->unique.size());
  for (size_t i = 0; i < keys->size(); ++i) {
    const Key& key = (*keys)[i];
    flat->order[lo + i] = key.pos;
    if (i == 0 || key.id != (*keys)[i - 1].id || key.shard != (*keys)[i - 1].shard) {
      flat->unique.push_back(key.id);
      flat->first.push_back(lo + static_cast<int64_t>(i));
    }
  }
  // where each shard's unique ids start (and where the last ends), absolute
  size_t u = static_cast<size_t>(u_lo);
  for (int64_t s = 0; s <= shards; ++s) {
    while (u < flat->unique.size() && (*keys)[flat->first[u] - lo].shard < s) ++u;
    flat->bounds.push_back(static_cast<int64_t>(u));
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
    for (size_t k = 0; k < count && ok; ++k) ok = route_table(ids.data(), t, k, &keys, &flat);
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
