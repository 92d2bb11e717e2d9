// pybind11 face of the megakernel runtime: trtllm_mk._mkrt.Module.
#include <pybind11/pybind11.h>

#include "megakernel_module.h"

namespace py = pybind11;
using trtllm_mk::LaunchConfig;
using trtllm_mk::MegakernelModule;

PYBIND11_MODULE(_mkrt, m) {
  m.doc() = "trtllm_mk megakernel runtime (CUDA driver API)";
  py::register_exception<trtllm_mk::CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::class_<MegakernelModule>(m, "Module")
      .def(py::init([](const std::string& cubin, const std::string& kernel, int grid, int block, int smem,
                       bool cooperative, int device) {
             LaunchConfig cfg;
             cfg.grid = grid;
             cfg.block = block;
             cfg.smem_bytes = smem;
             cfg.cooperative = cooperative;
             return new MegakernelModule(cubin, kernel, cfg, device);
           }),
           py::arg("cubin"), py::arg("kernel"), py::arg("grid"), py::arg("block"), py::arg("smem"),
           py::arg("cooperative") = true, py::arg("device") = 0)
      .def(
          "launch",
          [](const MegakernelModule& self, py::bytes params, uintptr_t stream) {
            std::string buf = params;  // copy: the driver reads the params during the call only
            py::gil_scoped_release nogil;
            self.launch(buf.data(), buf.size(), reinterpret_cast<CUstream>(stream));
          },
          py::arg("params"), py::arg("stream"),
          "Launch one decode step; params is the packed Params struct, stream a CUstream handle (int).")
      .def_property_readonly("device_sm_count", &MegakernelModule::device_sm_count)
      .def_property_readonly("max_active_ctas_per_sm", &MegakernelModule::max_active_ctas_per_sm);
}
