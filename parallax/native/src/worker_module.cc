// The worker kernels' registration in parallax.native._kernels (module.cc calls it).
#include "worker_kernels.h"

void register_worker(pybind11::module_& m) {
  parallax_worker::register_route(m);
  parallax_worker::register_pull(m);
  parallax_worker::register_push(m);
  parallax_worker::register_merge(m);
}
