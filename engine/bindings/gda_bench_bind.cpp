// pyep._engine part "gda_bench": post-rate measurements (host posters always; GPU posters in CUDA
// builds) and the GPU posting self-test launcher.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.h"
#include "mlx5gda/completion_sink.h"
#if defined(PYEP_WITH_CUDA)
#include "kernels/gda_kernels.h"
#endif

namespace py = pybind11;
using namespace pyep::gda;

static void register_gda_bench(py::module_& m) {
    py::class_<HostPostRateResult>(m, "HostPostRateResult")
        .def_readonly("elapsed_s", &HostPostRateResult::elapsed_s)
        .def_readonly("posts", &HostPostRateResult::posts)
        .def_readonly("sink_cqes", &HostPostRateResult::sink_cqes)
        .def_readonly("errors", &HostPostRateResult::errors)
        .def_readonly("max_outstanding", &HostPostRateResult::max_outstanding);
    m.def("host_post_rate", &run_host_post_rate, py::call_guard<py::gil_scoped_release>(), py::arg("threads"),
          py::arg("num_qps"), py::arg("log_sq"), py::arg("posts_per_thread"), py::arg("batch") = 1,
          py::arg("timeout_s") = 10.0,
          "CPU threads post 64-byte RDMA-write WQEs through qp.h into host rings completed by a sink thread.");
#if defined(PYEP_WITH_CUDA)
    py::class_<PostRateResult>(m, "PostRateResult")
        .def_readonly("elapsed_ms", &PostRateResult::elapsed_ms)
        .def_readonly("posts", &PostRateResult::posts)
        .def_readonly("doorbells", &PostRateResult::doorbells)
        .def_readonly("sink_cqes", &PostRateResult::sink_cqes)
        .def_readonly("errors", &PostRateResult::errors)
        .def_readonly("first_error", &PostRateResult::first_error);
    py::class_<PostRateBench>(m, "PostRateBench")
        .def(py::init<int, int, int>(), py::arg("device"), py::arg("num_qps"), py::arg("log_sq"))
        .def("run", &PostRateBench::run, py::call_guard<py::gil_scoped_release>(), py::arg("blocks"),
             py::arg("warps_per_block"), py::arg("warps_per_qp"), py::arg("posts_per_warp"), py::arg("batch") = 1,
             py::arg("timeout_s") = 10.0)
        .def_property_readonly("num_qps", &PostRateBench::num_qps);
    py::class_<PostWritesArgs>(m, "PostWritesArgs")
        .def(py::init<>())
        .def_readwrite("qp_ctx", &PostWritesArgs::qp_ctx)
        .def_readwrite("num_qps", &PostWritesArgs::num_qps)
        .def_readwrite("warps_per_qp", &PostWritesArgs::warps_per_qp)
        .def_readwrite("src", &PostWritesArgs::src)
        .def_readwrite("lkey", &PostWritesArgs::lkey)
        .def_readwrite("src_stride_qp", &PostWritesArgs::src_stride_qp)
        .def_readwrite("dst_table", &PostWritesArgs::dst_table)
        .def_readwrite("rkey_table", &PostWritesArgs::rkey_table)
        .def_readwrite("sig_table", &PostWritesArgs::sig_table)
        .def_readwrite("sig_rkey_table", &PostWritesArgs::sig_rkey_table)
        .def_readwrite("fetch", &PostWritesArgs::fetch)
        .def_readwrite("fetch_lkey", &PostWritesArgs::fetch_lkey)
        .def_readwrite("msgs_per_warp", &PostWritesArgs::msgs_per_warp)
        .def_readwrite("msg_bytes", &PostWritesArgs::msg_bytes)
        .def_readwrite("status", &PostWritesArgs::status)
        .def_readwrite("timeout_ns", &PostWritesArgs::timeout_ns)
        .def_readwrite("stream", &PostWritesArgs::stream);
    m.def("launch_post_writes", &launch_post_writes, py::arg("args"));
#endif
}

static pyep::bindings::Registrar registrar("gda_bench", &register_gda_bench);
