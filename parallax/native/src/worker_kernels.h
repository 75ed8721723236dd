// The worker's compiled data path (parallax.client.native_many calls it once per step):
// routing every table's ids to shards, encoding PullMany / PushMany request bodies, and
// scattering a PullMany answer's rows. Each function reproduces, bit for bit, what the
// numpy path (parallax.protocol.routing, packed_codec, wire_dtypes) computes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "hash64.h"

namespace parallax_worker {

namespace py = pybind11;
using Int64s = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Partition kinds, as parallax.client.native_many passes them.
constexpr int64_t kMod = 0;
constexpr int64_t kRange = 1;
constexpr int64_t kHashed = 2;

constexpr size_t kPrefixBytes = 8;  // u32 parts, u32 names length
constexpr size_t kAlign = 16;       // row blocks start 16-byte aligned

inline size_t up(size_t at, size_t align) { return at + ((align - at % align) % align); }

using parallax_hash::mix64;  // (hash64.h: parallax.protocol.routing.mix64)

inline int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// ShardRouter.shard_of for one id (numpy's floor semantics for // and %).
inline int64_t shard_of(int64_t id, int64_t kind, int64_t count, int64_t block) {
  if (kind == kHashed) return static_cast<int64_t>(mix64(static_cast<uint64_t>(id)) %
                                                   static_cast<uint64_t>(count));
  if (kind == kRange) return floor_div(id, block);
  if (id >= 0 && (count & (count - 1)) == 0) return id & (count - 1);  // 1, 2, 4... shards
  return id - floor_div(id, count) * count;
}

// One table's routing facts, read from the arrays the Python side passes.
struct Tables {
  const int64_t* starts;        // [T + 1] where each table's ids start among all ids
  const int64_t* shard_counts;  // [T]
  const int64_t* kinds;         // [T] kMod, kRange or kHashed
  const int64_t* blocks;        // [T] a range partition's block (>= 1)
  size_t count;
};

// Request packing shared by pulls and pushes: parts grouped by server in order of first
// appearance, then cut into requests of at most `limit` bytes (many._by_server, _packed).
struct Part {
  int64_t table, shard, lo, hi, chunk, chunks, nbytes;
};
struct Request {
  int64_t server;
  std::vector<Part> parts;
};
std::vector<Request> pack_by_server(const std::vector<Part>& parts,
                                    const int64_t* server_of, const int64_t* shard_base,
                                    int64_t limit);
// Every (shard, chunk) slice of one table (ShardedTable.slices); `offsets` has S + 1 entries.
void table_slices(int64_t table, const int64_t* offsets, int64_t shards, int64_t chunk_rows,
                  std::vector<Part>* out);

// float32 -> float16 / bfloat16 bits, exactly as parallax.protocol.wire_dtypes encodes.
uint16_t f16_bits(uint32_t bits);
uint16_t bf16_bits(uint32_t bits);

py::bytes new_bytes(size_t size, char** data);

void register_route(py::module_& m);
void register_pull(py::module_& m);
void register_push(py::module_& m);
void register_merge(py::module_& m);

}  // namespace parallax_worker
