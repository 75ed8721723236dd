// The parameter server's kernels, registered into parallax.native._kernels by module.cc.
#include "server_kernels.h"

namespace parallax_server {

void register_server(py::module_& m) {
  register_rows(m);
  register_sums(m);
  register_optimizers(m);
  register_init(m);
}

}  // namespace parallax_server
