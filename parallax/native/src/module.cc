// parallax.native._kernels: the compiled data path. Each kernel works on whole requests
// (every part of a pull or push in one call) with the GIL released; Python keeps control
// (tables, steps, checkpoints). See parallax/native/__init__.py for how it is chosen.
#include <pybind11/pybind11.h>

#include "server_kernels.h"

namespace py = pybind11;

// The kernels' ABI: parallax.native refuses a module whose number differs from its own
// (a stale build left in the tree after the Python side changed).
constexpr int kAbi = 5;

void register_worker(py::module_& m);  // worker_module.cc: the worker's fused pull and push

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "parallax's compiled data path (see parallax.native)";
  m.attr("ABI") = kAbi;
  parallax_server::register_server(m);
  register_worker(m);
}
