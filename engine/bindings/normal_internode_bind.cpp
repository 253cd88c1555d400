// pyep._engine part "relay": the normal mode's RDMA stage across nodes (normal_internode.h). CUDA
// builds only. One binding call per launch; pointers and the stream cross as Python ints.
#if defined(PYEP_WITH_CUDA)
#include <pybind11/pybind11.h>

#include "bindings/registry.h"
#include "kernels/normal_internode.h"
#include "mlx5gda/qp.h"

namespace py = pybind11;
using namespace pyep::normal;

namespace {

void register_relay(py::module_& m) {
    auto n = m.def_submodule("relay", "Normal-mode RDMA relay between the ranks of one column (pyep.ep.normal.internode)");
    py::class_<RelayStatic>(n, "RelayStatic")
        .def(py::init<>())
        .def_readwrite("node", &RelayStatic::node)
        .def_readwrite("num_nodes", &RelayStatic::num_nodes)
        .def_readwrite("ranks_per_node", &RelayStatic::ranks_per_node)
        .def_readwrite("local", &RelayStatic::local)
        .def_readwrite("buf", &RelayStatic::buf)
        .def_readwrite("remote_addr", &RelayStatic::remote_addr)
        .def_readwrite("rkeys", &RelayStatic::rkeys)
        .def_readwrite("lkey", &RelayStatic::lkey)
        .def_readwrite("qps", &RelayStatic::qps)
        .def_readwrite("num_qps_per_peer", &RelayStatic::num_qps_per_peer)
        .def_readwrite("off_tail", &RelayStatic::off_tail)
        .def_readwrite("off_head", &RelayStatic::off_head)
        .def_readwrite("off_tx", &RelayStatic::off_tx)
        .def_readwrite("off_rx", &RelayStatic::off_rx)
        .def_readwrite("off_count", &RelayStatic::off_count)
        .def_readwrite("off_outbox", &RelayStatic::off_outbox)
        .def_readwrite("off_fetch", &RelayStatic::off_fetch)
        .def_readwrite("off_send", &RelayStatic::off_send)
        .def_readwrite("off_recv", &RelayStatic::off_recv)
        .def_readwrite("ring_bytes", &RelayStatic::ring_bytes)
        .def_readwrite("err", &RelayStatic::err)
        .def_readwrite("workspace", &RelayStatic::workspace)
        .def_readwrite("timeout_ns", &RelayStatic::timeout_ns);
    n.attr("MAX_NODES") = kMaxNodes;
    n.attr("QP_CONTEXT_SIZE") = sizeof(pyep::gda::Qp);
    n.attr("PHASE_COUNTS") = (int)kPhaseRdmaCounts;
    n.attr("PHASE_DISPATCH") = (int)kPhaseRdmaDispatch;
    n.attr("PHASE_COMBINE") = (int)kPhaseRdmaCombine;
    n.def(
        "counts",
        [](const RelayStatic& s, int seq, uint64_t send_counts, uint64_t recv_counts, uint64_t host_counts,
           uint64_t stream) {
            RelayCountsArgs a;
            a.seq = seq;
            a.send_counts = send_counts;
            a.recv_counts = recv_counts;
            a.host_counts = host_counts;
            launch_relay_counts(s, a, stream);
        },
        "exchange this call's row counts with the column peers (RDMA writes of (seq, rows) records)");
    n.def(
        "relay",
        [](const RelayStatic& s, int phase, uint64_t src, uint64_t send_offsets, uint64_t dst, uint64_t recv_offsets,
           int row_bytes, int ring_tokens, int chunk_tokens, uint64_t stream) {
            RelayArgs a;
            a.phase = phase;
            a.src = src;
            a.send_offsets = send_offsets;
            a.dst = dst;
            a.recv_offsets = recv_offsets;
            a.row_bytes = row_bytes;
            a.ring_tokens = ring_tokens;
            a.chunk_tokens = chunk_tokens;
            launch_relay(s, a, stream);
        },
        "move rows to / from the column peers through the bounded RDMA rings");
}

pyep::bindings::Registrar reg("relay", &register_relay);

}  // namespace
#endif  // PYEP_WITH_CUDA
