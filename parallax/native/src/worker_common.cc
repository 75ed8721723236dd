// Shared pieces of the worker kernels: request packing (parallax.client.many), slices of a
// table's shards (ShardedTable.slices), wire dtypes (parallax.protocol.wire_dtypes).
#include <unordered_map>

#include "worker_kernels.h"

namespace parallax_worker {

std::vector<Request> pack_by_server(const std::vector<Part>& parts,
                                    const int64_t* server_of, const int64_t* shard_base,
                                    int64_t limit) {
  std::vector<int64_t> servers;  // in order of first appearance (many._by_server)
  std::unordered_map<int64_t, std::vector<Part>> by_server;
  for (const Part& part : parts) {
    int64_t server = server_of[shard_base[part.table] + part.shard];
    auto found = by_server.find(server);
    if (found == by_server.end()) {
      servers.push_back(server);
      found = by_server.emplace(server, std::vector<Part>()).first;
    }
    found->second.push_back(part);
  }
  std::vector<Request> out;
  for (int64_t server : servers) {  // many._packed: at least one part a request
    int64_t size = 0;
    bool open = false;
    for (const Part& part : by_server[server]) {
      if (open && size + part.nbytes > limit) open = false;
      if (!open) {
        out.push_back(Request{server, {}});
        size = 0;
        open = true;
      }
      out.back().parts.push_back(part);
      size += part.nbytes;
    }
  }
  return out;
}

void table_slices(int64_t table, const int64_t* offsets, int64_t shards, int64_t chunk_rows,
                  std::vector<Part>* out) {
  for (int64_t shard = 0; shard < shards; ++shard) {
    int64_t start = offsets[shard], stop = offsets[shard + 1];
    int64_t chunks = stop > start ? (stop - start + chunk_rows - 1) / chunk_rows : 1;
    for (int64_t index = 0; index < chunks; ++index) {
      int64_t lo = start + index * chunk_rows;
      int64_t hi = lo + chunk_rows < stop ? lo + chunk_rows : stop;
      out->push_back(Part{table, shard, lo, hi, index, chunks, 0});
    }
  }
}

static inline float as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint32_t as_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// wire_dtypes.f16_encode for one value: the same uint32 and float32 operations, in order.
uint16_t f16_bits(uint32_t bits) {
  constexpr uint32_t kAbs = 0x7FFFFFFFu, kInf = 0x7F800000u;
  constexpr uint32_t kInfAt = 0x477FF000u, kZeroAt = 97u << 23;
  constexpr uint32_t kNormalExp = 113u << 23, kRebias = 15u << 23;
  uint32_t mag = bits & kAbs;
  bool nan = mag > kInf;
  mag = mag < kZeroAt ? kZeroAt : (mag > kInfAt ? kInfAt : mag);
  float scaled = as_float(mag) * 4.0f;
  mag &= kInf;
  if (mag < kNormalExp) mag = kNormalExp;
  mag += kRebias;
  mag = as_bits(as_float(mag) + scaled);
  uint32_t exponent = (mag >> 13) & 0x7C00u;
  uint32_t half = (mag & 0x0FFFu) + exponent;
  if (nan) half = 0x7E00u | ((bits >> 13) & 0x3FFu);
  half |= (bits >> 16) & 0x8000u;
  return static_cast<uint16_t>(half);
}

// wire_dtypes.bf16_encode for one value.
uint16_t bf16_bits(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + (lsb + 0x7FFFu)) >> 16);
}

py::bytes new_bytes(size_t size, char** data) {
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
  if (raw == nullptr) throw py::error_already_set();
  *data = PyBytes_AS_STRING(raw);
  return py::reinterpret_steal<py::bytes>(raw);
}

}  // namespace parallax_worker
