// The Python module of the C++ CPU kernels. Every call releases the GIL while it computes, so
// the server's event-loop thread keeps running during a forward pass (torch's own operators
// release it too).
#include <torch/extension.h>

#include "cpu_ext.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("pack", &pdserve::pack, no_gil);
  m.def("linear", &pdserve::linear, no_gil);
  m.def("quant_pack", &pdserve::quant_pack, no_gil);
  m.def("quant_linear", &pdserve::quant_linear, no_gil);
  m.def("avx512_enabled", &pdserve::avx512_enabled);
  m.def("set_avx512", &pdserve::set_avx512);
  m.def("paged_attention", &pdserve::paged_attention, no_gil);
  m.def("rope_", &pdserve::rope_, no_gil);
  m.def("silu_mul", &pdserve::silu_mul, no_gil);
  m.def("rms_norm", &pdserve::rms_norm, no_gil);
  m.def("add_rms_norm_", &pdserve::add_rms_norm_, no_gil);
  m.def("apply_token_bitmask_", &pdserve::apply_token_bitmask_, no_gil);
}
