// A fused push: every table's gradient rows summed per routed id (PushRouting.fill), narrowed
// to the table's wire dtype (wire_dtypes.encode_checked), cut into parts and encoded as
// packed PushMany bodies (parallax.client.many.start_push_many, packed_codec.PushManyWriter).
#include <limits>
#include <stdexcept>
#include <string_view>

#include "worker_kernels.h"

namespace parallax_worker {
namespace {

constexpr int64_t kPushPartBytes = 88;  // packed_codec.PUSH_PART
constexpr int64_t kShortRun = 8;        // routing.SHORT_RUN: longer runs go to reduceat

struct PushTables {
  const int64_t* starts;      // [T + 1] each table's gradient rows among all ids
  const int64_t* order;       // the flat routing (Runs.flat_routing)
  const int64_t* unique;
  const int64_t* first;
  const int64_t* bounds;
  const int64_t* shard_counts;
  const int64_t* dims;
  const int64_t* chunk_rows;
  const int64_t* name_at;
  const char* names;
  const int64_t* server_of;
  const int64_t* shard_base;
  const int64_t* steps;
  const double* rates;
  const int64_t* sessions;
  const int64_t* narrow;      // 0: float32 on the wire, 1: float16, 2: bfloat16
  const int64_t* codes;       // the wire code of what a part's rows travel as
  const float* thresholds;    // the smallest magnitude a wire dtype makes infinite
  std::vector<const float*> grads;
  size_t count;
  int64_t bound_at(size_t k) const { return shard_base[k] + static_cast<int64_t>(k); }
  int64_t itemsize(size_t k) const { return narrow[k] ? 2 : 4; }
};

// numpy's pairwise summation of n >= 8 float32 values `stride` apart (what np.add.reduceat
// does along axis 0): 8 accumulators, combined pairwise, then the remainder in order.
float pairwise(const float* a, int64_t n, int64_t stride) {
  if (n > 128) {
    int64_t half = n / 2;
    half -= half % 8;
    return pairwise(a, half, stride) + pairwise(a + half * stride, n - half, stride);
  }
  float r[8];
  for (int j = 0; j < 8; ++j) r[j] = a[j * stride];
  int64_t i = 8;
  for (; i < n - (n % 8); i += 8)
    for (int j = 0; j < 8; ++j) r[j] += a[(i + j) * stride];
  float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
  for (; i < n; ++i) res += a[i * stride];
  return res;
}

// routing.sum_runs for one run of `count` rows at order[at:]: out = their sum.
void sum_run(const float* grads, const int64_t* order, int64_t at, int64_t count,
             int64_t base, int64_t dim, float* out, std::vector<float>* scratch) {
  std::memcpy(out, grads + (order[at] - base) * dim, 4 * static_cast<size_t>(dim));
  if (count <= kShortRun) {
    for (int64_t k = 1; k < count; ++k) {
      const float* row = grads + (order[at + k] - base) * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] += row[d];
    }
    return;
  }
  scratch->resize(static_cast<size_t>((count - 1) * dim));
  for (int64_t k = 1; k < count; ++k)
    std::memcpy(scratch->data() + (k - 1) * dim, grads + (order[at + k] - base) * dim,
                4 * static_cast<size_t>(dim));
  for (int64_t d = 0; d < dim; ++d) out[d] += pairwise(scratch->data() + d, count - 1, dim);
}

// Every table's summed rows into `sums` (at sum_at[k]); the first table whose sums a wire
// dtype would make infinite, or -1.
int64_t sum_tables(const PushTables& t, std::vector<float>* sums, std::vector<int64_t>* sum_at) {
  std::vector<float> scratch;
  for (size_t k = 0; k < t.count; ++k) {
    const int64_t* b = t.bounds + t.bound_at(k);
    int64_t u_lo = b[0], u_hi = b[t.shard_counts[k]], hi = t.starts[k + 1], dim = t.dims[k];
    sum_at->push_back(static_cast<int64_t>(sums->size()));
    sums->resize(sums->size() + static_cast<size_t>((u_hi - u_lo) * dim));
    float* out = sums->data() + sum_at->back();
    for (int64_t j = u_lo; j < u_hi; ++j) {
      int64_t end = j + 1 < u_hi ? t.first[j + 1] : hi;
      sum_run(t.grads[k], t.order, t.first[j], end - t.first[j], t.starts[k], dim,
              out + (j - u_lo) * dim, &scratch);
    }
    if (t.narrow[k] == 0) continue;
    for (int64_t i = 0; i < (u_hi - u_lo) * dim; ++i) {
      float v = out[i] < 0 ? -out[i] : out[i];
      if (v >= t.thresholds[k] && v <= std::numeric_limits<float>::max())
        return static_cast<int64_t>(k);
    }
  }
  return -1;
}

std::vector<Part> push_parts(const PushTables& t) {
  std::vector<Part> parts, slices;
  std::vector<int64_t> offsets;
  for (size_t k = 0; k < t.count; ++k) {
    const int64_t* b = t.bounds + t.bound_at(k);
    offsets.assign(b, b + t.shard_counts[k] + 1);
    for (int64_t& o : offsets) o -= b[0];
    slices.clear();
    table_slices(static_cast<int64_t>(k), offsets.data(), t.shard_counts[k], t.chunk_rows[k],
                 &slices);
    int64_t row_bytes = t.dims[k] * t.itemsize(k) + 8;
    int64_t fields = 192 + (t.name_at[k + 1] - t.name_at[k]);  // many._PART_FIELDS_BYTES
    for (Part p : slices) {
      p.nbytes = (p.hi - p.lo) * row_bytes + fields;
      parts.push_back(p);
    }
  }
  return parts;
}

struct Block {  // where a request's pieces go (packed_codec.PushManyWriter's layout)
  size_t names_at, ids_at, ids_end, size;
  std::vector<size_t> rows_at;
};

Block push_block(const PushTables& t, const Request& r) {
  Block b;
  size_t names = 0, ids = 0;
  for (const Part& p : r.parts) {
    names += static_cast<size_t>(t.name_at[p.table + 1] - t.name_at[p.table]);
    ids += static_cast<size_t>(p.hi - p.lo);
  }
  b.names_at = kPrefixBytes + kPushPartBytes * r.parts.size();
  b.ids_at = up(b.names_at + names, kAlign);
  b.ids_end = b.ids_at + 8 * ids;
  size_t at = up(b.ids_end, kAlign);
  for (const Part& p : r.parts) {
    b.rows_at.push_back(at);
    at = up(at + static_cast<size_t>((p.hi - p.lo) * t.dims[p.table]) * t.itemsize(p.table),
            kAlign);
  }
  b.size = at;
  return b;
}

void put_rows(const PushTables& t, const Part& p, const float* sums, char* out) {
  int64_t dim = t.dims[p.table], n = (p.hi - p.lo) * dim;
  const float* src = sums + p.lo * dim;
  if (t.narrow[p.table] == 0) {
    std::memcpy(out, src, 4 * static_cast<size_t>(n));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof bits);
    uint16_t half = t.narrow[p.table] == 1 ? f16_bits(bits) : bf16_bits(bits);
    std::memcpy(out + 2 * i, &half, sizeof half);
  }
}

void encode(const PushTables& t, int64_t worker, const Request& r, const Block& b,
            const float* sums, const int64_t* sum_at, char* out) {
  uint32_t prefix[2] = {static_cast<uint32_t>(r.parts.size()), 0};
  char* record = out + kPrefixBytes;
  char* names = out + b.names_at;
  char* ids = out + b.ids_at;
  for (size_t i = 0; i < r.parts.size(); ++i) {
    const Part& p = r.parts[i];
    size_t k = static_cast<size_t>(p.table);
    int64_t name_len = t.name_at[k + 1] - t.name_at[k];
    int64_t head[3] = {p.shard, t.steps[k], worker};
    int64_t tail[7] = {p.chunk, p.chunks, t.sessions[k], p.hi - p.lo, t.dims[k], t.codes[k],
                       name_len};
    std::memcpy(record, head, sizeof head);
    std::memcpy(record + sizeof head, &t.rates[k], sizeof(double));
    std::memcpy(record + sizeof head + sizeof(double), tail, sizeof tail);
    record += kPushPartBytes;
    std::memcpy(names, t.names + t.name_at[k], static_cast<size_t>(name_len));
    names += name_len;
    prefix[1] += static_cast<uint32_t>(name_len);
    const int64_t* u = t.unique + t.bounds[t.bound_at(k)];
    std::memcpy(ids, u + p.lo, 8 * static_cast<size_t>(p.hi - p.lo));
    ids += 8 * (p.hi - p.lo);
    put_rows(t, p, sums + sum_at[k], out + b.rows_at[i]);
    size_t end = b.rows_at[i] + static_cast<size_t>((p.hi - p.lo) * t.dims[k]) * t.itemsize(k);
    size_t next = i + 1 < r.parts.size() ? b.rows_at[i + 1] : b.size;
    std::memset(out + end, 0, next - end);
  }
  std::memcpy(out, prefix, sizeof prefix);
  std::memset(names, 0, b.ids_at - static_cast<size_t>(names - out));
  size_t rows = b.rows_at.empty() ? b.ids_end : b.rows_at[0];
  std::memset(out + b.ids_end, 0, rows - b.ids_end);
}

template <typename T>
const T* checked(const py::array_t<T, py::array::c_style | py::array::forcecast>& a,
                 size_t count, const char* what) {
  if (static_cast<size_t>(a.size()) != count)
    throw std::invalid_argument(std::string("push_encode: ") + what + " needs " +
                                std::to_string(count) + " entries, got " +
                                std::to_string(a.size()));
  return a.data();
}

py::object push_encode(py::dict routing, py::dict tables, py::list grads, Int64s steps,
                       py::array_t<double, py::array::c_style | py::array::forcecast> rates,
                       int64_t worker, int64_t limit) {
  auto arr = [](py::dict d, const char* key) { return d[key].cast<Int64s>(); };
  Int64s starts = arr(routing, "starts"), order = arr(routing, "order");
  Int64s unique = arr(routing, "unique"), first = arr(routing, "first");
  Int64s bounds = arr(routing, "bounds"), shard_counts = arr(tables, "shard_counts");
  Int64s dims = arr(tables, "dims"), chunk_rows = arr(tables, "chunk_rows");
  Int64s name_at = arr(tables, "name_at"), server_of = arr(tables, "server_of");
  Int64s shard_base = arr(tables, "shard_base"), sessions = arr(tables, "sessions");
  Int64s narrow = arr(tables, "narrow"), codes = arr(tables, "codes");
  auto thresholds = tables["thresholds"].cast<
      py::array_t<float, py::array::c_style | py::array::forcecast>>();
  std::string_view names = tables["names"].cast<std::string_view>();
  size_t count = static_cast<size_t>(shard_counts.size());
  PushTables t{checked(starts, count + 1, "starts"), order.data(), unique.data(), first.data(),
               bounds.data(), shard_counts.data(), checked(dims, count, "dims"),
               checked(chunk_rows, count, "chunk_rows"), checked(name_at, count + 1, "name_at"),
               names.data(), server_of.data(), checked(shard_base, count + 1, "shard_base"),
               checked(steps, count, "steps"), checked(rates, count, "rates"),
               checked(sessions, count, "sessions"), checked(narrow, count, "narrow"),
               checked(codes, count, "codes"), checked(thresholds, count, "thresholds"),
               {}, count};
  std::vector<py::array_t<float, py::array::c_style>> held;
  for (size_t k = 0; k < count; ++k) {
    held.push_back(grads[k].cast<py::array_t<float, py::array::c_style>>());
    if (held.back().size() != (t.starts[k + 1] - t.starts[k]) * t.dims[k])
      throw std::invalid_argument("push_encode: gradient " + std::to_string(k) + " has " +
                                  std::to_string(held.back().size()) + " values, its ids ask "
                                  "for rows x dim");
    t.grads.push_back(held.back().data());
  }
  std::vector<float> sums;
  std::vector<int64_t> sum_at;
  std::vector<Request> requests;
  std::vector<Block> blocks;
  int64_t bad;
  {
    py::gil_scoped_release release;
    bad = sum_tables(t, &sums, &sum_at);
    if (bad < 0) requests = pack_by_server(push_parts(t), t.server_of, t.shard_base, limit);
    for (const Request& r : requests) blocks.push_back(push_block(t, r));
  }
  if (bad >= 0) return py::int_(bad);
  py::list servers, bodies, parts;
  std::vector<char*> data(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    bodies.append(new_bytes(blocks[i].size, &data[i]));
    servers.append(requests[i].server);
    py::array_t<int64_t> tab_shard({static_cast<py::ssize_t>(requests[i].parts.size()),
                                    py::ssize_t{2}});
    auto view = tab_shard.mutable_unchecked<2>();
    for (size_t j = 0; j < requests[i].parts.size(); ++j)
      view(j, 0) = requests[i].parts[j].table, view(j, 1) = requests[i].parts[j].shard;
    parts.append(tab_shard);
  }
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < requests.size(); ++i)
      encode(t, worker, requests[i], blocks[i], sums.data(), sum_at.data(), data[i]);
  }
  return py::make_tuple(servers, bodies, parts);
}

}  // namespace

void register_push(py::module_& m) {
  m.def("push_encode", &push_encode, py::arg("routing"), py::arg("tables"), py::arg("grads"),
        py::arg("steps"), py::arg("rates"), py::arg("worker"), py::arg("limit"),
        "A fused push's PushMany bodies: (servers, bodies, [(table, shard) of each part]), "
        "or the index of the first table whose summed gradient its wire dtype would make "
        "infinite (the numpy path raises the error).");
}

}  // namespace parallax_worker
