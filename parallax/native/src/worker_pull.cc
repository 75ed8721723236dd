// A fused pull: every table's ids laid out by shard, cut into parts and encoded as one packed
// PullMany body per server (parallax.client.many.start_pull_many, packed_codec's layout);
// then each answer's rows scattered into the tables' rows (PendingPull.result).
#include <limits>
#include <stdexcept>
#include <string_view>

#include "worker_kernels.h"

namespace parallax_worker {
namespace {

constexpr int64_t kPullPartBytes = 32;    // packed_codec.PULL_PART
constexpr int64_t kAnswerPartBytes = 32;  // packed_codec.PULL_ANSWER_PART

// The tables' configuration, as native_many passes it (arrays of one entry per table).
struct PullTables {
  Tables t;
  const int64_t* chunk_rows;
  const int64_t* row_bytes;    // max(dim * itemsize, 8): what a row adds to a part
  const int64_t* name_at;      // [T + 1] each table's name in `names`
  const char* names;
  const int64_t* server_of;    // [sum S] the server of each table shard
  const int64_t* shard_base;   // [T + 1] where each table's shards start in server_of
  const int64_t* min_steps;
};

struct Layout {
  std::vector<int64_t> ids, pos, offsets;  // offsets: S + 1 per table, table-relative
  std::vector<int64_t> offset_at;          // [T] where each table's offsets start
};

// Python's ShardRouter.shard_order: a stable order by shard.
void by_shard(const int64_t* ids, const Tables& t, size_t k, Layout* out) {
  int64_t lo = t.starts[k], hi = t.starts[k + 1], shards = t.shard_counts[k];
  std::vector<int64_t> shard(static_cast<size_t>(hi - lo)), next(shards + 1, 0);
  for (int64_t i = lo; i < hi; ++i) {
    shard[i - lo] = shard_of(ids[i], t.kinds[k], shards, t.blocks[k]);
    next[shard[i - lo] + 1] += 1;
  }
  for (int64_t s = 0; s < shards; ++s) next[s + 1] += next[s];
  out->offsets.insert(out->offsets.end(), next.begin(), next.end());
  for (int64_t i = lo; i < hi; ++i) {
    int64_t at = lo + next[shard[i - lo]]++;
    out->pos[at] = i - lo;
    out->ids[at] = ids[i];
  }
}

// many._pull_layout for every table: ids as they are (one shard), their push routing
// (`routed`: a training step's pull of distinct ids), or stably by shard.
bool lay_out(const int64_t* ids, const Tables& t, bool routed, const int64_t* order,
             const int64_t* unique, const int64_t* bounds, Layout* out) {
  size_t n = static_cast<size_t>(t.starts[t.count]);
  out->ids.assign(n, 0);
  out->pos.assign(n, 0);
  int64_t bound_at = 0;
  for (size_t k = 0; k < t.count; ++k) {
    int64_t lo = t.starts[k], hi = t.starts[k + 1], shards = t.shard_counts[k];
    out->offset_at.push_back(static_cast<int64_t>(out->offsets.size()));
    const int64_t* b = routed ? bounds + bound_at : nullptr;
    bound_at += shards + 1;
    if (shards == 1) {
      for (int64_t i = lo; i < hi; ++i) out->ids[i] = ids[i], out->pos[i] = i - lo;
      out->offsets.push_back(0);
      out->offsets.push_back(hi - lo);
    } else if (b != nullptr && b[shards] - b[0] == hi - lo) {
      for (int64_t i = lo; i < hi; ++i)
        out->ids[i] = unique[b[0] + i - lo], out->pos[i] = order[i] - lo;
      for (int64_t s = 0; s <= shards; ++s) out->offsets.push_back(b[s] - b[0]);
    } else {
      if (shards < 1) return false;
      for (int64_t i = lo; i < hi; ++i) {
        int64_t s = shard_of(ids[i], t.kinds[k], shards, t.blocks[k]);
        if (s < 0 || s >= shards) return false;
      }
      by_shard(ids, t, k, out);
    }
  }
  return true;
}

std::vector<Part> pull_parts(const PullTables& c, const Layout& layout) {
  std::vector<Part> parts, slices;
  for (size_t k = 0; k < c.t.count; ++k) {
    slices.clear();
    table_slices(static_cast<int64_t>(k), layout.offsets.data() + layout.offset_at[k],
                 c.t.shard_counts[k], c.chunk_rows[k], &slices);
    int64_t fields = 192 + (c.name_at[k + 1] - c.name_at[k]);  // many._PART_FIELDS_BYTES
    for (Part p : slices) {
      if (p.hi > p.lo || c.min_steps[k] > 0) {
        p.nbytes = (p.hi - p.lo) * c.row_bytes[k] + fields;
        parts.push_back(p);
      }
    }
  }
  return parts;
}

size_t body_size(const PullTables& c, const Request& r) {
  size_t names = 0, ids = 0;
  for (const Part& p : r.parts) {
    names += static_cast<size_t>(c.name_at[p.table + 1] - c.name_at[p.table]);
    ids += static_cast<size_t>(p.hi - p.lo);
  }
  return up(kPrefixBytes + kPullPartBytes * r.parts.size() + names, 8) + 8 * ids;
}

void encode(const PullTables& c, const Layout& layout, const Request& r, char* out,
            size_t size) {
  uint32_t prefix[2] = {static_cast<uint32_t>(r.parts.size()), 0};
  char* record = out + kPrefixBytes;
  char* names = record + kPullPartBytes * r.parts.size();
  for (const Part& p : r.parts) {
    int64_t name_len = c.name_at[p.table + 1] - c.name_at[p.table];
    int64_t fields[4] = {p.shard, c.min_steps[p.table], p.hi - p.lo, name_len};
    std::memcpy(record, fields, sizeof fields);
    record += sizeof fields;
    std::memcpy(names, c.names + c.name_at[p.table], static_cast<size_t>(name_len));
    names += name_len;
    prefix[1] += static_cast<uint32_t>(name_len);
  }
  std::memcpy(out, prefix, sizeof prefix);
  char* ids = out + up(static_cast<size_t>(names - out), 8);
  std::memset(names, 0, static_cast<size_t>(ids - names));
  for (const Part& p : r.parts) {
    size_t bytes = 8 * static_cast<size_t>(p.hi - p.lo);
    std::memcpy(ids, layout.ids.data() + c.t.starts[p.table] + p.lo, bytes);
    ids += bytes;
  }
  (void)size;
}

py::array_t<int64_t> parts_array(const Request& r) {
  py::array_t<int64_t> out({static_cast<py::ssize_t>(r.parts.size()), py::ssize_t{3}});
  auto view = out.mutable_unchecked<2>();
  for (size_t i = 0; i < r.parts.size(); ++i) {
    view(i, 0) = r.parts[i].table, view(i, 1) = r.parts[i].lo, view(i, 2) = r.parts[i].hi;
  }
  return out;
}

py::object pull_plan(Int64s ids, Int64s starts, Int64s shard_counts, Int64s kinds,
                     Int64s blocks, bool routed, Int64s order, Int64s unique, Int64s bounds,
                     Int64s chunk_rows, Int64s row_bytes, Int64s name_at, py::bytes names,
                     Int64s server_of, Int64s shard_base, Int64s min_steps, int64_t limit) {
  size_t count = static_cast<size_t>(shard_counts.size());
  for (const Int64s* a : {&kinds, &blocks, &chunk_rows, &row_bytes, &min_steps})
    if (static_cast<size_t>(a->size()) != count)
      throw std::invalid_argument("pull_plan: every per-table array needs one entry a table");
  if (static_cast<size_t>(starts.size()) != count + 1 || starts.data()[count] != ids.size())
    throw std::invalid_argument("pull_plan: starts must be T + 1 run starts ending at len(ids)");
  std::string_view name_block = names;
  PullTables c{{starts.data(), shard_counts.data(), kinds.data(), blocks.data(), count},
               chunk_rows.data(), row_bytes.data(), name_at.data(), name_block.data(),
               server_of.data(), shard_base.data(), min_steps.data()};
  Layout layout;
  std::vector<Request> requests;
  std::vector<size_t> sizes;
  bool ok;
  {
    py::gil_scoped_release release;
    ok = lay_out(ids.data(), c.t, routed, order.data(), unique.data(), bounds.data(), &layout);
    if (ok) requests = pack_by_server(pull_parts(c, layout), c.server_of, c.shard_base, limit);
    for (size_t i = 0; ok && i < requests.size(); ++i) {
      // several requests to one server wait first (many._start_pull): the numpy path's
      ok = i == 0 || requests[i].server != requests[i - 1].server;
      sizes.push_back(body_size(c, requests[i]));
    }
  }
  if (!ok) return py::none();
  py::list servers, bodies, parts;
  std::vector<char*> data(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    bodies.append(new_bytes(sizes[i], &data[i]));
    servers.append(requests[i].server);
    parts.append(parts_array(requests[i]));
  }
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < requests.size(); ++i) encode(c, layout, requests[i], data[i], sizes[i]);
  }
  py::array_t<int64_t> pos(static_cast<py::ssize_t>(layout.pos.size()));
  if (!layout.pos.empty())
    std::memcpy(pos.mutable_data(), layout.pos.data(), layout.pos.size() * sizeof(int64_t));
  return py::make_tuple(servers, bodies, parts, pos);
}

// ---- the answer -----------------------------------------------------------------------
struct AnswerPart {
  int64_t step, count, dim, dtype;
};

struct Codes {
  int64_t f32, f16, bf16;
  int64_t itemsize(int64_t code) const {
    return code == f32 ? 4 : (code == f16 || code == bf16) ? 2 : 0;
  }
};

// Where each part's rows start, after the checks packed_codec.decode_pull_many_answer and
// PendingPull.result make; empty if any fails (the numpy path then reports it).
bool answer_blocks(const char* body, size_t size, const int64_t* parts, size_t count,
                   const int64_t* dims, const Codes& codes, std::vector<size_t>* offsets) {
  uint32_t prefix[2];
  if (size < kPrefixBytes) return false;
  std::memcpy(prefix, body, sizeof prefix);
  size_t at = kPrefixBytes + kAnswerPartBytes * static_cast<size_t>(prefix[0]);
  if (prefix[0] != count || prefix[1] != 0 || at > size) return false;
  size_t end = up(at, kAlign);
  for (size_t i = 0; i < count; ++i) {
    AnswerPart a;
    std::memcpy(&a, body + kPrefixBytes + kAnswerPartBytes * i, sizeof a);
    int64_t table = parts[3 * i], rows = parts[3 * i + 2] - parts[3 * i + 1];
    int64_t itemsize = codes.itemsize(a.dtype);
    if (a.count != rows || a.dim != dims[table] || itemsize == 0 || a.dim < 0 ||
        a.dim > std::numeric_limits<int32_t>::max() ||
        (a.dim > 0 && a.count > static_cast<int64_t>(size) / (a.dim * itemsize)))
      return false;
    offsets->push_back(end);
    end = up(end + static_cast<size_t>(a.count * a.dim * itemsize), kAlign);
  }
  return end == size;
}

void scatter_part(const char* src, int64_t code, const Codes& codes, float* rows,
                  const int64_t* pos, int64_t count, int64_t dim, const float* f16_table) {
  for (int64_t r = 0; r < count; ++r) {
    float* dst = rows + pos[r] * dim;
    if (code == codes.f32) {
      std::memcpy(dst, src + 4 * r * dim, 4 * static_cast<size_t>(dim));
      continue;
    }
    const uint16_t* half = reinterpret_cast<const uint16_t*>(src) + r * dim;
    for (int64_t d = 0; d < dim; ++d) {
      uint16_t h;
      std::memcpy(&h, half + d, sizeof h);
      if (code == codes.f16) {
        dst[d] = f16_table[h];
      } else {
        uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(dst + d, &bits, sizeof bits);
      }
    }
  }
}

bool pull_scatter(py::buffer body, Int64s parts, Int64s pos, Int64s starts, Int64s dims,
                  Int64s elem_base, py::array_t<float, py::array::c_style> out,
                  py::array_t<float, py::array::c_style> f16_table, Int64s codes) {
  py::buffer_info info = body.request();
  if (parts.ndim() != 2 || parts.shape(1) != 3 || f16_table.size() != 65536 || codes.size() != 3)
    throw std::invalid_argument("pull_scatter: parts must be [P, 3], the float16 table 65536 "
                                "floats and the codes (float32, float16, bfloat16)");
  const char* data = static_cast<const char*>(info.ptr);
  size_t size = static_cast<size_t>(info.size * info.itemsize);
  Codes c{codes.data()[0], codes.data()[1], codes.data()[2]};
  size_t count = static_cast<size_t>(parts.shape(0));
  const int64_t* p = parts.data();
  float* rows = out.mutable_data();
  py::gil_scoped_release release;
  std::vector<size_t> offsets;
  if (!answer_blocks(data, size, p, count, dims.data(), c, &offsets)) return false;
  for (size_t i = 0; i < count; ++i) {
    AnswerPart a;
    std::memcpy(&a, data + kPrefixBytes + kAnswerPartBytes * i, sizeof a);
    int64_t table = p[3 * i];
    scatter_part(data + offsets[i], a.dtype, c, rows + elem_base.data()[table],
                 pos.data() + starts.data()[table] + p[3 * i + 1], a.count, a.dim,
                 f16_table.data());
  }
  return true;
}

}  // namespace

void register_pull(py::module_& m) {
  m.def("pull_plan", &pull_plan,
        "A fused pull's PullMany bodies: (servers, bodies, parts, layout positions), or None "
        "where the numpy path must make it (several requests to one server, unchecked ids).");
  m.def("pull_scatter", &pull_scatter,
        "Scatter one packed PullMany answer's rows into the tables' rows; False (nothing "
        "written) when the answer is not what was asked: the numpy path decodes it then.");
}

}  // namespace parallax_worker
