// Server-side optimizers' sparse apply on float32 rows (servers/parallax_ps/optimizers.py is
// the reference): the touched rows and slots are gathered into new arrays and updated there,
// element by element with numpy's float32 operations in numpy's order; the caller checks and
// writes them back. The step's scalars (learning rate, bias corrections, Nadam's schedule)
// are computed by the caller with numpy's own scalar arithmetic and passed as float32
// constants. Ftrl (numpy's power) stays in Python.
#include "server_kernels.h"

#include <vector>

namespace parallax_server {

namespace {

// The kernels, in the order native_path.py numbers them; slots in the spec's slot_names order.
enum Kind : int {
  kSgd = 0,          // c: lr
  kSgdMomentum = 1,  // c: lr, momentum; slots: momentum
  kSgdNesterov = 2,  // c: lr, momentum; slots: momentum
  kAdagrad = 3,      // c: lr, epsilon; slots: accumulator
  kAdam = 4,         // c: alpha, 1 - beta_1, 1 - beta_2, epsilon; slots: momentum, velocity
  kAdamAmsgrad = 5,  // as kAdam; slots: + velocity_hat
  kRmsprop = 6,      // c: lr, rho, 1 - rho, epsilon, momentum, centered; slots: velocity,
                     //    [momentum], [average_gradient]
  kAdamax = 7,       // c: lr, 1 - beta_1, beta_2, epsilon, 1 - beta_1 ** t; momentum, norm
  kNadam = 8,        // c: lr, 1 - beta_1, 1 - beta_2, u_t_1, 1 - u_product_t_1, 1 - u_t,
                     //    1 - u_product_t, 1 - beta_2 ** t, epsilon; momentum, velocity
  kLion = 9,         // c: lr, beta_1, 1 - beta_1, beta_2, 1 - beta_2; slots: momentum
};

constexpr int kSlotsOf[] = {0, 1, 1, 1, 2, 3, -1, 2, 2, 1};  // -1: RMSprop counts its own

void rmsprop(const float* c, float& w, float** s, float g) {
  const float lr = c[0], rho = c[1], rest = c[2], eps = c[3], momentum = c[4];
  const bool centered = c[5] != 0.0f;
  float& velocity = *s[0];
  velocity = rho * velocity + rest * (g * g);
  float denominator;
  if (centered) {
    float& average = *s[momentum > 0.0f ? 2 : 1];
    average = rho * average + rest * g;
    denominator = (velocity - average * average) + eps;
  } else {
    denominator = velocity + eps;
  }
  const float increment = (lr * g) / std::sqrt(denominator);
  if (momentum > 0.0f) {
    float& m = *s[1];
    m = momentum * m + increment;
    w = w - m;
  } else {
    w = w - increment;
  }
}

void nadam(const float* c, float& w, float** s, float g) {
  float& m = *s[0];
  float& v = *s[1];
  m = m + (g - m) * c[1];
  v = v + (g * g - v) * c[2];
  const float m_hat = (c[3] * m) / c[4] + (c[5] * g) / c[6];
  const float v_hat = v / c[7];
  w = w - (m_hat * c[0]) / (std::sqrt(v_hat) + c[8]);
}

// One element's update: w and its slots in place, g its gradient.
template <int K>
inline void apply(const float* c, float& w, float* const* s, ssize_t e, float g) {
  if constexpr (K == kSgd) {
    w = w - g * c[0];
  } else if constexpr (K == kSgdMomentum || K == kSgdNesterov) {
    float& m = s[0][e];
    m = m * c[1] - g * c[0];
    w = K == kSgdNesterov ? w + (m * c[1] - g * c[0]) : w + m;
  } else if constexpr (K == kAdagrad) {
    float& acc = s[0][e];
    acc = acc + g * g;
    w = w - (c[0] * g) / std::sqrt(acc + c[1]);
  } else if constexpr (K == kAdam || K == kAdamAmsgrad) {
    float& m = s[0][e];
    float& v = s[1][e];
    m = m + (g - m) * c[1];
    v = v + (g * g - v) * c[2];
    float used = v;
    if constexpr (K == kAdamAmsgrad) used = s[2][e] = np_maximum(s[2][e], v);
    w = w - (m * c[0]) / (std::sqrt(used) + c[3]);
  } else if constexpr (K == kRmsprop) {
    float* slots[3] = {s[0] + e, s[1] ? s[1] + e : nullptr, s[2] ? s[2] + e : nullptr};
    rmsprop(c, w, slots, g);
  } else if constexpr (K == kAdamax) {
    float& m = s[0][e];
    float& u = s[1][e];
    m = m + (g - m) * c[1];
    u = np_maximum(c[2] * u, std::fabs(g));
    w = w - (c[0] * m) / (c[4] * (u + c[3]));
  } else if constexpr (K == kNadam) {
    float* slots[2] = {s[0] + e, s[1] + e};
    nadam(c, w, slots, g);
  } else {
    static_assert(K == kLion, "every kernel has its update");
    float& m = s[0][e];
    w = w - c[0] * np_sign(m * c[1] + g * c[2]);
    m = m * c[3] + g * c[4];
  }
}

template <int K>
void apply_all(const float* c, float* w, float* const* s, const float* g, ssize_t count) {
  for (ssize_t e = 0; e < count; ++e) apply<K>(c, w[e], s, e, g[e]);
}

using Loop = void (*)(const float*, float*, float* const*, const float*, ssize_t);
constexpr Loop kLoops[] = {apply_all<kSgd>,        apply_all<kSgdMomentum>, apply_all<kSgdNesterov>,
                           apply_all<kAdagrad>,    apply_all<kAdam>,        apply_all<kAdamAmsgrad>,
                           apply_all<kRmsprop>,    apply_all<kAdamax>,      apply_all<kNadam>,
                           apply_all<kLion>};

bool finite_all(const float* values, ssize_t count) {
  uint32_t bad = 0;
  for (ssize_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof bits);
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

// A new [n, dim] array of from[rows]; returns its storage.
float* gathered(const In<float>& from, const int64_t* rows, ssize_t n, ssize_t dim,
                py::array_t<float>& into) {
  into = py::array_t<float>({n, dim});
  float* out = into.mutable_data();
  const float* src = from.data();
  for (ssize_t i = 0; i < n; ++i) {
    prefetch_ahead(src, rows, i, n, dim);
    std::memcpy(out + i * dim, src + rows[i] * dim, dim * sizeof(float));
  }
  return out;
}

void check(int kind, const In<float>& values, const std::vector<In<float>>& slots,
           const In<int64_t>& rows, const In<float>& grads) {
  if (kind < kSgd || kind > kLion) throw std::invalid_argument("unknown optimizer kernel");
  const ssize_t expected = kSlotsOf[kind];
  if ((expected >= 0 && static_cast<ssize_t>(slots.size()) != expected) || slots.size() > 3) {
    throw std::invalid_argument("wrong number of optimizer slots");
  }
  if (values.ndim() != 2 || rows.ndim() != 1 || grads.ndim() != 2 ||
      grads.shape(0) != rows.shape(0) || grads.shape(1) != values.shape(1)) {
    throw std::invalid_argument("update: values [R, dim], rows [n], grads [n, dim]");
  }
  for (const auto& slot : slots) {
    if (slot.ndim() != 2 || slot.shape(0) != values.shape(0) ||
        slot.shape(1) != values.shape(1)) {
      throw std::invalid_argument("update: each slot is [R, dim] like values");
    }
  }
  const int64_t* r = rows.data();
  for (ssize_t i = 0; i < rows.shape(0); ++i) {
    if (r[i] < 0 || r[i] >= values.shape(0)) throw std::out_of_range("update: row outside");
  }
}

// (new values of rows, [new slots], whether all are finite): copies, nothing is written.
py::tuple update(int kind, const std::vector<float>& consts, const In<float>& values,
                 const std::vector<In<float>>& slots, const In<int64_t>& rows,
                 const In<float>& grads) {
  check(kind, values, slots, rows, grads);
  const ssize_t n = rows.shape(0), dim = values.shape(1);
  const int64_t* r = rows.data();
  py::array_t<float> w;
  float* wp = gathered(values, r, n, dim, w);
  std::vector<py::array_t<float>> new_slots(slots.size());
  std::vector<float*> sp;
  for (size_t k = 0; k < slots.size(); ++k) {
    sp.push_back(gathered(slots[k], r, n, dim, new_slots[k]));
  }
  bool finite = true;
  {
    MaybeReleased released(n * dim * 4 * static_cast<ssize_t>(2 + 2 * sp.size()));
    float* slot_rows[3] = {nullptr, nullptr, nullptr};
    for (size_t k = 0; k < sp.size(); ++k) slot_rows[k] = sp[k];
    kLoops[kind](consts.data(), wp, slot_rows, grads.data(), n * dim);
    finite = finite_all(wp, n * dim);
    for (float* slot : sp) finite = finite && finite_all(slot, n * dim);
  }
  py::list out_slots;
  for (auto& slot : new_slots) out_slots.append(slot);
  return py::make_tuple(w, out_slots, finite);
}

}  // namespace

void register_optimizers(py::module_& m) {
  m.def("update", &update, py::arg("kind"), py::arg("consts"), py::arg("values"),
        py::arg("slots"), py::arg("rows"), py::arg("grads"),
        "(new values, [new slots], all finite) of float32 rows after one optimizer step");
}

}  // namespace parallax_server
