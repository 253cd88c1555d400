// CPU simulation of the normal mode's RDMA relay for CI (no GPU, no NIC): engine/kernels/
// normal_internode_relay.cu compiled as host C++ against cuda_shim.h, as ll_sim.cpp does for the LL
// kernels. The column peers (one rank per simulated node) run their grids at once, one OS thread per GPU
// thread, against host buffers laid out by pyep/ep/normal/internode_relay.py (RelayLayout); their qp.h
// queue pairs are executed by the shared in-process NIC (sim_nic.h). A rank left out of a launch is a
// peer that never launched.
#define PYEP_LL_CPU_SIM 1
#include "cuda_shim.h"

#include "kernels/normal_internode_relay.cu"
#include "sim_nic.h"

#include "sim_args.h"

#include <string>
#include <utility>
#include <vector>

using namespace pyep;
using namespace pyep::normal;

namespace {

using sim_args::set;

RelayStatic static_from(const py::dict& d) {
    RelayStatic s;
    set(d, "node", s.node); set(d, "num_nodes", s.num_nodes); set(d, "ranks_per_node", s.ranks_per_node);
    set(d, "local", s.local); set(d, "buf", s.buf); set(d, "remote_addr", s.remote_addr); set(d, "rkeys", s.rkeys);
    set(d, "lkey", s.lkey); set(d, "qps", s.qps); set(d, "num_qps_per_peer", s.num_qps_per_peer);
    set(d, "off_tail", s.off_tail); set(d, "off_head", s.off_head); set(d, "off_tx", s.off_tx);
    set(d, "off_rx", s.off_rx); set(d, "off_count", s.off_count); set(d, "off_outbox", s.off_outbox);
    set(d, "off_fetch", s.off_fetch); set(d, "off_send", s.off_send); set(d, "off_recv", s.off_recv);
    set(d, "ring_bytes", s.ring_bytes); set(d, "err", s.err); set(d, "workspace", s.workspace);
    set(d, "timeout_ns", s.timeout_ns); set(d, "tag_record", s.tag_record);
    if (d.contains("active")) set(d, "active", s.active);
    return s;
}

RelayCountsArgs counts_from(const py::dict& d) {
    RelayCountsArgs a;
    set(d, "host_ticket", a.host_ticket); set(d, "send_counts", a.send_counts);
    set(d, "recv_counts", a.recv_counts); set(d, "host_counts", a.host_counts);
    set(d, "kind", a.kind); set(d, "status", a.status); set(d, "origin", a.origin); set(d, "upstream", a.upstream);
    if (d.contains("handle_tag")) set(d, "handle_tag", a.handle_tag);
    return a;
}

RelayArgs relay_from(const py::dict& d) {
    RelayArgs a;
    set(d, "phase", a.phase); set(d, "src", a.src); set(d, "send_offsets", a.send_offsets); set(d, "dst", a.dst);
    set(d, "recv_offsets", a.recv_offsets); set(d, "row_bytes", a.row_bytes); set(d, "ring_tokens", a.ring_tokens);
    set(d, "chunk_tokens", a.chunk_tokens); set(d, "dst_capacity", a.dst_capacity);
    return a;
}

constexpr size_t kBlockScratch = 1024;   // normal_common.cuh block_shared()

// Every listed rank's grid at once, after the launcher's own argument checks (what the GPU launchers check).
template <typename FromDict, typename Check, typename Grid>
void launch_on_every_rank(const py::list& statics, const py::list& args, FromDict from_dict, Check check, Grid grid) {
    using Args = decltype(from_dict(std::declval<py::dict>()));
    std::vector<RelayStatic> ss;
    std::vector<Args> as;
    for (size_t i = 0; i < statics.size(); ++i) {
        ss.push_back(static_from(statics[i].cast<py::dict>()));
        as.push_back(from_dict(args[i].cast<py::dict>()));
        check(ss.back(), as.back());
    }
    py::gil_scoped_release nogil;
    SimLaunch launch;
    for (size_t i = 0; i < ss.size(); ++i) grid(ss[i], as[i], launch);
    launch.join();
}

}  // namespace

PYBIND11_MODULE(relay_sim, m) {
    m.attr("threads_per_block") = kRelayThreads;
    // One count exchange: relay_counts_kernel on every listed rank at once (1 block of 32, as launched).
    m.def("counts", [](const py::list& statics, const py::list& args) {
        launch_on_every_rank(statics, args, counts_from, check_relay_counts,
                             [](const RelayStatic& s, const RelayCountsArgs& a, SimLaunch& launch) {
                                 launch.grid(1, 32, kBlockScratch, [=] { relay_counts_kernel(s, a); });
                             });
    });
    // One relay of rows: relay_kernel on every listed rank at once (2M blocks, as launched).
    m.def("relay", [](const py::list& statics, const py::list& args) {
        launch_on_every_rank(statics, args, relay_from, check_relay,
                             [](const RelayStatic& s, const RelayArgs& a, SimLaunch& launch) {
                                 launch.grid(2 * s.num_nodes, kRelayThreads, kBlockScratch, [=] { relay_kernel(s, a); });
                             });
    });
    py::class_<SimNic>(m, "SimNic")
        .def(py::init<std::vector<uint64_t>, std::vector<uint64_t>, int, int>())
        .def("contexts", &SimNic::contexts)
        .def("errors", &SimNic::errors)
        .def("executed", &SimNic::executed);
}
