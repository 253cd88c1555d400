// pyep._engine part "gda_loopback": the GPU-initiated loopback kernels (`pyep qp loopback`, CUDA builds)
// and, in every build, what the QP dump needs: a decoder of gda::Qp context bytes (so Python never
// hard-codes qp.h's layout) and a reader of host or device memory.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "bindings/registry.h"
#include "kernels/gda_loopback.h"
#include "mlx5gda/qp.h"

namespace py = pybind11;

namespace pyep {
namespace bindings {
namespace {

constexpr size_t kMaxRead = 64u << 20;  // a dump reads contexts and CQ rings, never more than this

py::dict decode_qp_context(const py::bytes& raw) {
    const std::string s = raw;
    if (s.size() != sizeof(gda::Qp))
        throw py::value_error("a gda::Qp context is " + std::to_string(sizeof(gda::Qp)) + " bytes, got " +
                              std::to_string(s.size()));
    gda::Qp q;
    std::memcpy(&q, s.data(), sizeof q);
    py::dict d;
    d["qpn"] = q.qpn;
    d["log_sq"] = q.log_sq;
    d["sq"] = (uint64_t)(uintptr_t)q.sq;
    d["dbrec"] = (uint64_t)(uintptr_t)q.dbrec;
    d["bf"] = (uint64_t)(uintptr_t)q.bf;
    d["bf_size"] = q.bf_size;
    d["bf_offset"] = q.bf_offset;
    d["resv"] = q.resv;
    d["ready"] = q.ready;
    d["cons"] = q.cons;
    d["signaled"] = q.signaled;
    d["wqes_posted"] = q.wqes_posted;
    d["bytes_posted"] = q.bytes_posted;
    d["cq_cqes"] = (uint64_t)(uintptr_t)q.cq.cqes;
    d["cq_dbrec"] = (uint64_t)(uintptr_t)q.cq.dbrec;
    d["cq_log_size"] = q.cq.log_size;
    d["cq_lock"] = q.cq.lock;
    d["cq_ci"] = q.cq.ci;
    py::dict e;
    e["valid"] = q.err.valid != 0;
    e["kind"] = q.err.kind;
    e["cqe_opcode"] = q.err.cqe_opcode;
    e["syndrome"] = q.err.syndrome;
    e["vendor_syndrome"] = q.err.vendor_syndrome;
    e["wqe_opcode"] = q.err.wqe_opcode;
    e["wqe_counter"] = q.err.wqe_counter;
    e["when_ns"] = q.err.when_ns;
    d["err"] = e;
    return d;
}

py::bytes read_memory(uint64_t addr, uint64_t n) {
    if (addr == 0) throw py::value_error("read_memory: address 0");
    if (n == 0 || n > kMaxRead) throw py::value_error("read_memory: length must be in 1.." + std::to_string(kMaxRead));
    std::string out;
    {
        py::gil_scoped_release r;
#if defined(PYEP_WITH_CUDA)
        out = gda::read_memory(addr, (size_t)n);
#else
        // Host-only build: no device memory exists in this process.
        out.assign(reinterpret_cast<const char*>(addr), (size_t)n);
#endif
    }
    return py::bytes(out);
}

#if defined(PYEP_WITH_CUDA)
uint64_t to_ns(double timeout_s) {
    if (!(timeout_s > 0) || timeout_s > 3600)
        throw py::value_error("timeout_s must be in (0, 3600] seconds, got " + std::to_string(timeout_s));
    return (uint64_t)(timeout_s * 1e9);
}

void register_kernels(py::module_& m) {
    using gda::LoopEndpoint;
    py::class_<LoopEndpoint>(m, "LoopEndpoint", "One end of a GPU loopback pair (addresses as its GPU sees them)")
        .def(py::init<>())
        .def_readwrite("qp", &LoopEndpoint::qp)
        .def_readwrite("src", &LoopEndpoint::src)
        .def_readwrite("lkey", &LoopEndpoint::lkey)
        .def_readwrite("dst", &LoopEndpoint::dst)
        .def_readwrite("rkey", &LoopEndpoint::rkey)
        .def_readwrite("sig_remote", &LoopEndpoint::sig_remote)
        .def_readwrite("sig_rkey", &LoopEndpoint::sig_rkey)
        .def_readwrite("sig_local", &LoopEndpoint::sig_local)
        .def_readwrite("fetch", &LoopEndpoint::fetch)
        .def_readwrite("fetch_lkey", &LoopEndpoint::fetch_lkey)
        .def_readwrite("samples", &LoopEndpoint::samples)
        .def_readwrite("result", &LoopEndpoint::result);
    m.def("launch_loop_latency",
          [](const LoopEndpoint& ep0, const LoopEndpoint* ep1, int first_role, int device, uint32_t size,
             uint32_t iters, uint32_t warmup, double timeout_s, uint64_t stream) {
              gda::LoopLatencyArgs a;
              a.ep[0] = ep0;
              a.num_here = 1;
              if (ep1) {
                  a.ep[1] = *ep1;
                  a.num_here = 2;
              }
              a.first_role = first_role;
              a.device = device;
              a.size = size;
              a.iters = iters;
              a.warmup = warmup;
              a.timeout_ns = to_ns(timeout_s);
              a.stream = stream;
              gda::launch_loop_latency(a);   // std::invalid_argument reaches Python as ValueError (pybind11)
          },
          py::arg("ep0"), py::arg("ep1"), py::arg("first_role"), py::arg("device"), py::arg("size"), py::arg("iters"),
          py::arg("warmup"), py::arg("timeout_s"), py::arg("stream"),
          "Ping-pong kernel: ep0 (role first_role) and, if given, ep1 (the other role) in one launch.");
    m.def("launch_loop_bandwidth",
          [](const LoopEndpoint& ep, int device, uint32_t size, uint32_t iters, uint32_t warmup, double timeout_s,
             uint64_t stream) {
              gda::LoopBandwidthArgs a;
              a.ep = ep;
              a.device = device;
              a.size = size;
              a.iters = iters;
              a.warmup = warmup;
              a.timeout_ns = to_ns(timeout_s);
              a.stream = stream;
              gda::launch_loop_bandwidth(a);   // std::invalid_argument reaches Python as ValueError (pybind11)
          },
          py::arg("ep"), py::arg("device"), py::arg("size"), py::arg("iters"), py::arg("warmup"), py::arg("timeout_s"),
          py::arg("stream"), "Streaming-write kernel on ep (the last write carries a +1 signal).");
    m.attr("loop_result_fields") =
        py::make_tuple("status", "stage", "iterations", "start_ns", "end_ns", "last_signal");
    static_assert(sizeof(gda::LoopResult) == 6 * sizeof(uint64_t), "LoopResult is read as int64[6]");
}
#endif

void register_gda_loopback(py::module_& m) {
    m.def("decode_qp_context", &decode_qp_context, py::arg("raw"),
          "The fields of a gda::Qp device context (qp.h), from its bytes.");
    m.attr("qp_context_size") = sizeof(gda::Qp);
    m.def("read_memory", &read_memory, py::arg("addr"), py::arg("length"),
          "Bytes at a host or (CUDA builds) device address; device memory is read on a non-blocking stream.");
#if defined(PYEP_WITH_CUDA)
    register_kernels(m);
#endif
}

const Registrar registrar("gda_loopback", &register_gda_loopback);

}  // namespace
}  // namespace bindings
}  // namespace pyep
