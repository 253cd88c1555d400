// CPU simulation of the low-latency EP kernels for CI (no GPU): engine/kernels/ll_*.cu compiled as host
// C++ against cuda_shim.h. Every simulated rank's grid runs at once, one OS thread per GPU thread,
// against host buffers; peers reach each other by direct stores (the NVLink/local path) or through
// qp.h queue pairs executed by a small in-process NIC (the IBGDA path: RDMA writes as memcpy, masked
// FA32 as an atomic add, one CQE per doorbell), which also checks every key and address range.
#define PYEP_LL_CPU_SIM 1
#include "cuda_shim.h"

#include "kernels/ll_combine.cu"
#include "kernels/ll_dispatch.cu"
#include "kernels/ll_runtime.cu"
#include "sim_nic.h"

#include "sim_args.h"

#include <cstdlib>
#include <thread>
#include <vector>
#include <string>

using namespace pyep;

namespace {

using sim_args::set;

ll::LLStatic static_from(const py::dict& d) {
    ll::LLStatic s;
    set(d, "rank", s.rank); set(d, "num_ranks", s.num_ranks); set(d, "num_local_experts", s.num_local_experts);
    set(d, "num_max_tokens", s.num_max_tokens); set(d, "hidden", s.hidden); set(d, "max_topk", s.max_topk);
    set(d, "buf", s.buf); set(d, "peer_base", s.peer_base); set(d, "remote_addr", s.remote_addr);
    set(d, "rkeys", s.rkeys); set(d, "lkey", s.lkey); set(d, "qps", s.qps);
    set(d, "num_qps_per_peer", s.num_qps_per_peer); set(d, "flag_expect", s.flag_expect);
    set(d, "fetch_addr", s.fetch_addr); set(d, "workspace", s.workspace); set(d, "half_bytes", s.half_bytes);
    set(d, "off_dsig", s.off_dsig); set(d, "off_csig", s.off_csig); set(d, "off_cack", s.off_cack);
    set(d, "off_drecv", s.off_drecv);
    set(d, "off_crecv", s.off_crecv); set(d, "msg_bytes", s.msg_bytes); set(d, "slots_per_src", s.slots_per_src);
    set(d, "num_blocks", s.num_blocks);
    if (d.contains("err")) set(d, "err", s.err);   // the error record (host memory here), optional
    if (d.contains("call_err")) set(d, "call_err", s.call_err);   // the call record, optional
    if (d.contains("peer_gen")) set(d, "peer_gen", s.peer_gen);   // int32 [R] generations, optional
    if (d.contains("trace")) set(d, "trace", s.trace);            // per-block timeline, optional
    ll::check_static(s);
    return s;
}

ll::LLDispatchCall dispatch_from(const py::dict& d) {
    ll::LLDispatchCall c;
    set(d, "x", c.x); set(d, "topk", c.topk); set(d, "num_tokens", c.num_tokens); set(d, "num_topk", c.num_topk);
    set(d, "half", c.half); set(d, "use_fp8", c.use_fp8); set(d, "round_scale", c.round_scale);
    set(d, "use_ue8m0", c.use_ue8m0); set(d, "active", c.active); set(d, "recv_x", c.recv_x);
    set(d, "recv_scales", c.recv_scales); set(d, "src_info", c.src_info); set(d, "recv_slot", c.recv_slot);
    set(d, "layout_range", c.layout_range); set(d, "recv_count", c.recv_count); set(d, "cum_stats", c.cum_stats);
    set(d, "timeout_ns", c.timeout_ns); set(d, "phases", c.phases);
    if (d.contains("wait_stats")) set(d, "wait_stats", c.wait_stats);   // int64 [R] or 0, optional
    if (d.contains("seq")) set(d, "seq", c.seq);
    if (d.contains("abort")) set(d, "abort", c.abort);
    return c;
}

ll::LLCombineCall combine_from(const py::dict& d) {
    ll::LLCombineCall c;
    set(d, "x", c.x); set(d, "topk", c.topk); set(d, "weights", c.weights); set(d, "num_tokens", c.num_tokens);
    set(d, "num_topk", c.num_topk); set(d, "half", c.half); set(d, "src_info", c.src_info);
    set(d, "recv_slot", c.recv_slot); set(d, "layout_range", c.layout_range); set(d, "active", c.active);
    set(d, "out", c.out); set(d, "timeout_ns", c.timeout_ns); set(d, "phases", c.phases);
    if (d.contains("use_logfmt")) set(d, "use_logfmt", c.use_logfmt);
    if (d.contains("wait_stats")) set(d, "wait_stats", c.wait_stats);
    if (d.contains("repeat")) set(d, "repeat", c.repeat);
    if (d.contains("seq")) set(d, "seq", c.seq);
    if (d.contains("abort")) set(d, "abort", c.abort);
    return c;
}

// The combine kernel has one instance per payload format; launch_combine picks it the same way.
void run_combine(const ll::LLStatic& s, const ll::LLCombineCall& c) {
    if (c.use_logfmt) ll::combine<true>(s, c);
    else ll::combine<false>(s, c);
}

// Runs one launch per listed rank, all at once; returns when every simulated thread has finished.
template <typename Call, typename Kernel>
void run_grids(const std::vector<ll::LLStatic>& ss, const std::vector<Call>& cs, Kernel kernel, int smem) {
    SimLaunch launch;
    for (size_t i = 0; i < ss.size(); ++i) {
        const ll::LLStatic s = ss[i];
        const Call c = cs[i];
        launch.grid(s.num_blocks, ll::kThreadsPerBlock, (size_t)smem, [=] { kernel(s, c); });
    }
    launch.join();
}

// One rank's launches in stream order: each grid runs after the previous one has finished, as the calls
// of one stream do, with no host step in between.
struct Launch {
    bool combine;
    ll::LLStatic s;
    ll::LLDispatchCall d;
    ll::LLCombineCall c;
};

void run_stream(const std::vector<Launch>& launches) {
    for (const Launch& l : launches) {
        SimLaunch launch;
        const ll::LLStatic s = l.s;
        if (l.combine) {
            const ll::LLCombineCall c = l.c;
            launch.grid(s.num_blocks, ll::kThreadsPerBlock, (size_t)ll::combine_smem_bytes(s), [=] { run_combine(s, c); });
        } else {
            const ll::LLDispatchCall c = l.d;
            auto kern = c.use_fp8 ? ll::dispatch<true> : ll::dispatch<false>;
            launch.grid(s.num_blocks, ll::kThreadsPerBlock, (size_t)ll::dispatch_smem_bytes(s), [=] { kern(s, c); });
        }
        launch.join();
    }
}

}  // namespace

PYBIND11_MODULE(ll_sim, m) {
    m.attr("threads_per_block") = ll::kThreadsPerBlock;
    m.attr("trace_slots") = ll::kTraceSlots;
    m.def("dispatch", [](const py::list& statics, const py::list& calls) {
        std::vector<ll::LLStatic> ss;
        std::vector<ll::LLDispatchCall> cs;
        for (size_t i = 0; i < statics.size(); ++i) {
            ss.push_back(static_from(statics[i].cast<py::dict>()));
            cs.push_back(dispatch_from(calls[i].cast<py::dict>()));
            ll::check_call(ss.back(), cs.back());   // what launch_dispatch checks first
        }
        const int smem = ll::dispatch_smem_bytes(ss.at(0));
        const bool fp8 = cs.at(0).use_fp8 != 0;
        py::gil_scoped_release nogil;
        if (fp8) run_grids(ss, cs, ll::dispatch<true>, smem);
        else run_grids(ss, cs, ll::dispatch<false>, smem);
    });
    m.def("combine", [](const py::list& statics, const py::list& calls) {
        std::vector<ll::LLStatic> ss;
        std::vector<ll::LLCombineCall> cs;
        for (size_t i = 0; i < statics.size(); ++i) {
            ss.push_back(static_from(statics[i].cast<py::dict>()));
            cs.push_back(combine_from(calls[i].cast<py::dict>()));
            ll::check_call(ss.back(), cs.back());
        }
        const int smem = ll::combine_smem_bytes(ss.at(0));
        py::gil_scoped_release nogil;
        run_grids(ss, cs, run_combine, smem);
    });
    // streams: one list per rank of ("dispatch" | "combine", static, call); every rank's list runs in
    // order (stream order, no host sync between its launches), all ranks at once.
    m.def("streams", [](const py::list& streams) {
        std::vector<std::vector<Launch>> all;
        for (const auto& st : streams) {
            std::vector<Launch> ls;
            for (const auto& item : st.cast<py::list>()) {
                const auto t = item.cast<py::tuple>();
                Launch l{};
                l.combine = t[0].cast<std::string>() == "combine";
                l.s = static_from(t[1].cast<py::dict>());
                if (l.combine) {
                    l.c = combine_from(t[2].cast<py::dict>());
                    ll::check_call(l.s, l.c);
                } else {
                    l.d = dispatch_from(t[2].cast<py::dict>());
                    ll::check_call(l.s, l.d);
                }
                ls.push_back(l);
            }
            all.push_back(std::move(ls));
        }
        py::gil_scoped_release nogil;
        std::vector<std::thread> threads;
        for (const auto& ls : all) threads.emplace_back([&ls] { run_stream(ls); });
        for (auto& t : threads) t.join();
    });
    py::class_<SimNic>(m, "SimNic")
        .def(py::init<std::vector<uint64_t>, std::vector<uint64_t>, int, int, std::vector<uint64_t>>(), py::arg("bufs"),
             py::arg("sizes"), py::arg("nqp"), py::arg("log_sq"), py::arg("lag_ns") = std::vector<uint64_t>{})
        .def("contexts", &SimNic::contexts)
        .def("errors", &SimNic::errors)
        .def("executed", &SimNic::executed)
        .def("idle", &SimNic::idle);
}
