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
  m.def("shm_post", &pdserve::shm_post, no_gil);
  m.def("shm_wait_gather", &pdserve::shm_wait_gather, no_gil);
  py::class_<pdserve::Projection>(m, "Projection")
      .def(py::init<>())
      .def_readwrite("packed", &pdserve::Projection::packed)
      .def_readwrite("types", &pdserve::Projection::types)
      .def_readwrite("ns", &pdserve::Projection::ns)
      .def_readwrite("dense", &pdserve::Projection::dense)
      .def_readwrite("out_features", &pdserve::Projection::out_features)
      .def_readwrite("bias", &pdserve::Projection::bias)
      .def_readwrite("segments", &pdserve::Projection::segments)
      .def_readwrite("bounds", &pdserve::Projection::bounds);
  py::class_<pdserve::DecoderLayer>(m, "DecoderLayer")
      .def(py::init<>())
      .def_readwrite("qkv", &pdserve::DecoderLayer::qkv)
      .def_readwrite("o_proj", &pdserve::DecoderLayer::o_proj)
      .def_readwrite("gate_up", &pdserve::DecoderLayer::gate_up)
      .def_readwrite("down", &pdserve::DecoderLayer::down)
      .def_readwrite("input_norm", &pdserve::DecoderLayer::input_norm)
      .def_readwrite("post_norm", &pdserve::DecoderLayer::post_norm);
  py::class_<pdserve::DecoderStack>(m, "DecoderStack")
      .def(py::init<>())
      .def_readwrite("layers", &pdserve::DecoderStack::layers)
      .def_readwrite("pools", &pdserve::DecoderStack::pools)
      .def_readwrite("num_heads", &pdserve::DecoderStack::num_heads)
      .def_readwrite("num_kv_heads", &pdserve::DecoderStack::num_kv_heads)
      .def_readwrite("head_dim", &pdserve::DecoderStack::head_dim)
      .def_readwrite("sliding_window", &pdserve::DecoderStack::sliding_window)
      .def_readwrite("scale", &pdserve::DecoderStack::scale)
      .def_readwrite("eps", &pdserve::DecoderStack::eps)
      .def("forward_", &pdserve::DecoderStack::forward_, no_gil);
}
