// CPU simulation of the normal mode's intranode kernels for CI (no GPU): engine/kernels/normal_notify.cu
// (layout, route, the call gate and count exchange), normal_dispatch.cu and normal_combine.cu compiled as
// host C++ against cuda_shim.h, as ll_sim.cpp does for the LL kernels.
// Every simulated rank's grid runs at once, one OS thread per GPU thread, against host buffers laid out
// by pyep/ep/normal/layout.py; a peer's ring is reached by direct stores, as over NVLink. The bulk
// copies (TMA) are the warp's own copies here.
#define PYEP_LL_CPU_SIM 1
#include "cuda_shim.h"

#include "kernels/normal_combine.cu"
#include "kernels/normal_dispatch.cu"
#include "kernels/normal_notify.cu"

#include "sim_args.h"

#include <string>
#include <vector>

using namespace pyep;
using namespace pyep::normal;

namespace {

using sim_args::opt;
using sim_args::set;

NormalStatic static_from(const py::dict& d) {
    NormalStatic s;
    set(d, "rank", s.rank); set(d, "num_ranks", s.num_ranks); set(d, "buf", s.buf); set(d, "peer_base", s.peer_base);
    set(d, "ring_off", s.ring_off); set(d, "ring_capacity", s.ring_capacity); set(d, "slot_bytes", s.slot_bytes);
    set(d, "off_tail", s.off_tail); set(d, "off_head", s.off_head); set(d, "off_tx", s.off_tx); set(d, "off_rx", s.off_rx);
    set(d, "off_alive", s.off_alive);
    set(d, "err", s.err); set(d, "workspace", s.workspace); set(d, "timeout_ns", s.timeout_ns);
    opt(d, "active", s.active);
    opt(d, "off_direct", s.off_direct); opt(d, "off_pulled", s.off_pulled); opt(d, "trace", s.trace); opt(d, "pool_lo", s.pool_lo); opt(d, "pool_hi", s.pool_hi);
    opt(d, "off_flag", s.off_flag); opt(d, "off_notify", s.off_notify); opt(d, "notify_ints", s.notify_ints);
    set(d, "host_counts", s.host_counts); set(d, "tag_record", s.tag_record); set(d, "layout_scratch", s.layout_scratch);
    check_static(s);   // the launchers' own checks (normal_notify.cu)
    // A receiving block gives each source at least one warp: kDispatchWarps / R (4 warps here).
    if (s.num_ranks > kDispatchWarps || s.num_ranks > kCombineWarps)
        throw py::value_error("the simulation's blocks have too few warps for " + std::to_string(s.num_ranks) + " ranks");
    return s;
}

DispatchArgs dispatch_from(const py::dict& d) {
    DispatchArgs a;
    set(d, "x", a.x); set(d, "x_scales", a.x_scales);
    opt(d, "scale_token_stride", a.scale_token_stride); opt(d, "scale_group_stride", a.scale_group_stride);
    set(d, "topk_idx", a.topk_idx); set(d, "topk_weights", a.topk_weights);
    set(d, "is_token_in_rank", a.is_token_in_rank); set(d, "rank_prefix_matrix", a.rank_prefix_matrix);
    set(d, "channel_prefix_matrix", a.channel_prefix_matrix);
    set(d, "recv_channel_prefix_matrix", a.recv_channel_prefix_matrix);
    set(d, "num_tokens", a.num_tokens); set(d, "hidden", a.hidden); set(d, "num_topk", a.num_topk);
    set(d, "num_local_experts", a.num_local_experts); set(d, "fp8", a.fp8); set(d, "num_channels", a.num_channels);
    set(d, "ring_tokens", a.ring_tokens); set(d, "chunk_tokens", a.chunk_tokens); set(d, "num_out_rows", a.num_out_rows);
    set(d, "use_tma", a.use_tma); set(d, "recv_x", a.recv_x); set(d, "recv_x_scales", a.recv_x_scales);
    set(d, "recv_topk_idx", a.recv_topk_idx); set(d, "recv_topk_weights", a.recv_topk_weights);
    set(d, "recv_src_idx", a.recv_src_idx);
    opt(d, "num_worst_tokens", a.num_worst_tokens); opt(d, "send_head", a.send_head); opt(d, "dropped", a.dropped);
    opt(d, "direct", a.direct); opt(d, "direct_offer", a.direct_offer); opt(d, "direct_stage", a.direct_stage);
    return a;
}

LayoutArgs layout_from(const py::dict& d) {
    LayoutArgs a;
    set(d, "topk", a.topk); set(d, "num_tokens", a.num_tokens); set(d, "num_topk", a.num_topk);
    set(d, "num_experts", a.num_experts); set(d, "num_tokens_per_rank", a.num_tokens_per_rank);
    set(d, "num_tokens_per_expert", a.num_tokens_per_expert); set(d, "is_token_in_rank", a.is_token_in_rank);
    opt(d, "dropped", a.dropped);
    return a;
}

NotifyArgs notify_from(const py::dict& d) {
    NotifyArgs a;
    set(d, "topk", a.topk); set(d, "num_topk", a.num_topk); set(d, "num_tokens_per_rank", a.num_tokens_per_rank);
    set(d, "num_tokens_per_expert", a.num_tokens_per_expert); set(d, "is_token_in_rank", a.is_token_in_rank);
    set(d, "num_tokens", a.num_tokens); set(d, "num_experts", a.num_experts); set(d, "num_channels", a.num_channels);
    set(d, "rank_prefix_matrix", a.rank_prefix_matrix); set(d, "channel_prefix_matrix", a.channel_prefix_matrix);
    set(d, "recv_channel_prefix_matrix", a.recv_channel_prefix_matrix); set(d, "send_head", a.send_head);
    opt(d, "expert_alignment", a.expert_alignment); opt(d, "num_worst_tokens", a.num_worst_tokens);
    opt(d, "gate_only", a.gate_only); opt(d, "kind", a.kind); opt(d, "status", a.status);
    opt(d, "check_layout", a.check_layout); opt(d, "dropped", a.dropped); opt(d, "tag_out", a.tag_out);
    opt(d, "pull_offer", a.pull_offer); opt(d, "pull_rows", a.pull_rows); opt(d, "pull_x", a.pull_x);
    if (d.contains("sig")) {
        const auto sig = d["sig"].cast<std::vector<int>>();
        for (size_t i = 0; i < sig.size() && i < (size_t)kTagSigHandle; ++i) a.sig[i] = sig[i];
    }
    return a;
}

CombineArgs combine_from(const py::dict& d) {
    CombineArgs a;
    set(d, "x", a.x); set(d, "topk_weights", a.topk_weights); set(d, "send_head", a.send_head);
    set(d, "rank_prefix_matrix", a.rank_prefix_matrix); set(d, "channel_prefix_matrix", a.channel_prefix_matrix);
    set(d, "recv_channel_prefix_matrix", a.recv_channel_prefix_matrix);
    set(d, "num_tokens", a.num_tokens); set(d, "hidden", a.hidden); set(d, "num_topk", a.num_topk);
    set(d, "num_channels", a.num_channels); set(d, "ring_tokens", a.ring_tokens); set(d, "chunk_tokens", a.chunk_tokens);
    set(d, "out", a.out); set(d, "out_weights", a.out_weights);
    opt(d, "bias0", a.bias0); opt(d, "bias1", a.bias1); opt(d, "dropped", a.dropped);
    opt(d, "use_tma", a.use_tma); opt(d, "pull", a.pull);
    return a;
}

constexpr size_t kBlockScratch = kSimBlockScratch;   // normal_common.cuh block_shared()

// Every listed rank's grid at once.
template <typename Args, typename FromDict, typename Kernel>
void launch_on_every_rank(const py::list& statics, const py::list& args, FromDict from_dict, int threads,
                          Kernel kernel) {
    std::vector<NormalStatic> ss;
    std::vector<Args> as;
    for (size_t i = 0; i < statics.size(); ++i) {
        ss.push_back(static_from(statics[i].cast<py::dict>()));
        as.push_back(from_dict(args[i].cast<py::dict>()));
    }
    py::gil_scoped_release nogil;
    SimLaunch launch;
    for (size_t i = 0; i < ss.size(); ++i) {
        const NormalStatic s = ss[i];
        const Args a = as[i];
        // block_shared() scratch, then the warps' bulk-copy stages (normal_tma.cuh tma_shared()).
        launch.grid(2 * a.num_channels, threads, kBlockScratch + tma_smem_bytes(threads / 32), [=] { kernel(s, a); });
    }
    launch.join();
}

}  // namespace

PYBIND11_MODULE(normal_sim, m) {
    m.attr("dispatch_threads") = kDispatchThreads;
    m.attr("combine_threads") = kCombineThreads;
    m.attr("trace_words") = kTraceWords;
    m.attr("desc_ints") = kDescInts;
    m.attr("desc_path") = kDescPath;
    // normal_launch.h NormalError by pyep/ep/normal/errors.py's names: the test checks that file against it.
    // A code this list misses is caught by tests/test_error_enums.py, which reads the enum from the header.
    py::dict codes;
    codes["ERR_NONE"] = (int)kErrNone; codes["ERR_EXPERT_ID"] = (int)kErrExpertId;
    codes["ERR_WORST_TOKENS"] = (int)kErrWorstTokens; codes["ERR_PEER_TIMEOUT"] = (int)kErrPeerTimeout;
    codes["ERR_BAD_HANDLE"] = (int)kErrBadHandle; codes["ERR_IN_RANK"] = (int)kErrInRank;
    codes["ERR_EXPERT_COUNT"] = (int)kErrExpertCount; codes["ERR_RANK_COUNT"] = (int)kErrRankCount;
    codes["ERR_NODE_COUNT"] = (int)kErrNodeCount; codes["ERR_VOID_HANDLE"] = (int)kErrVoidHandle;
    codes["ERR_DIRECT_DESC"] = (int)kErrDirectDesc; codes["ERR_LOST_PATH"] = (int)kErrLostPath;
    m.attr("error_codes") = codes;
    m.attr("phases") = py::make_tuple((int)kPhaseNotify, (int)kPhaseDispatch, (int)kPhaseCombine);
    // One dispatch: the dispatch kernel on every listed rank at once (2C blocks, as launched).
    // `between`, if given, is called after the one-copy kernel and before the ring kernel.
    m.def("dispatch", [](const py::list& statics, const py::list& args, const py::object& between) {
        for (size_t i = 0; i < statics.size(); ++i) {
            const DispatchArgs a = dispatch_from(args[i].cast<py::dict>());
            check_rings(static_from(statics[i].cast<py::dict>()), "normal dispatch", a.num_channels, a.ring_tokens,
                        dispatch_row_bytes(a.hidden, a.fp8, a.num_topk), a.hidden);
        }
        // As launch_dispatch does: the one-copy kernel first when the call runs the handshake (the
        // gate makes a.direct the same on every rank), then the ring kernel.
        if (dispatch_from(args[0].cast<py::dict>()).direct)
            launch_on_every_rank<DispatchArgs>(statics, args, dispatch_from, kDispatchThreads,
                                               [](const NormalStatic& s, const DispatchArgs& a) {
                                                   if (a.direct) dispatch_one_copy(s, a);
                                               });
        if (!between.is_none()) between();
        launch_on_every_rank<DispatchArgs>(statics, args, dispatch_from, kDispatchThreads,
                                           [](const NormalStatic& s, const DispatchArgs& a) { dispatch(s, a); });
    }, py::arg("statics"), py::arg("args"), py::arg("between") = py::none());
    // get_dispatch_layout on one rank (the layout kernel exchanges nothing).
    m.def("layout", [](const py::dict& st, const py::dict& args) {
        const NormalStatic s = static_from(st);
        const LayoutArgs a = layout_from(args);
        std::memset(reinterpret_cast<void*>(a.num_tokens_per_rank), 0, 4ull * s.num_ranks);
        std::memset(reinterpret_cast<void*>(a.num_tokens_per_expert), 0, 4ull * a.num_experts);
        if (a.num_tokens == 0) return;
        py::gil_scoped_release nogil;
        SimLaunch launch;
        const int blocks = std::min(4, (a.num_tokens + 255) / 256);
        launch.grid(blocks, 256, kBlockScratch + 4ull * (a.num_experts + 2 * s.num_ranks), [=] { normal_layout_kernel(s, a); });
    });
    // One call's routing and gate (count exchange): the route kernel on every listed rank, then the notify
    // kernel on all of them at once (1 block, as launched); gate_only: the notify kernel alone.
    m.def("notify", [](const py::list& statics, const py::list& args) {
        std::vector<NormalStatic> ss;
        std::vector<NotifyArgs> as;
        for (size_t i = 0; i < statics.size(); ++i) {
            ss.push_back(static_from(statics[i].cast<py::dict>()));
            as.push_back(notify_from(args[i].cast<py::dict>()));
            if (ss.back().notify_ints < (uint32_t)kNotifyExtra)
                throw py::value_error("notify needs off_flag, off_notify and notify_ints");
        }
        py::gil_scoped_release nogil;
        {
            SimLaunch route;
            for (size_t i = 0; i < ss.size(); ++i) {
                const NormalStatic s = ss[i];
                const NotifyArgs a = as[i];
                if (a.gate_only) continue;
                if (a.check_layout) std::memset(reinterpret_cast<void*>(s.layout_scratch), 0, 4ull * a.num_experts);
                route.grid(a.num_channels, 32 * s.num_ranks, kBlockScratch, [=] { normal_route_kernel(s, a); });
            }
        }
        SimLaunch gate;
        for (size_t i = 0; i < ss.size(); ++i) {
            const NormalStatic s = ss[i];
            const NotifyArgs a = as[i];
            gate.grid(1, kNotifyThreads, kBlockScratch, [=] { normal_notify_kernel(s, a); });
        }
    });
    // One combine: the combine kernel on every listed rank at once.
    m.def("combine", [](const py::list& statics, const py::list& args) {
        for (size_t i = 0; i < statics.size(); ++i) {
            const CombineArgs a = combine_from(args[i].cast<py::dict>());
            check_rings(static_from(statics[i].cast<py::dict>()), "normal combine", a.num_channels, a.ring_tokens,
                        combine_row_bytes(a.hidden, a.num_topk), a.hidden);
        }
        launch_on_every_rank<CombineArgs>(statics, args, combine_from, kCombineThreads,
                                          [](const NormalStatic& s, const CombineArgs& a) {
                                              if (s.trace && a.pull) combine<true, true>(s, a);
                                              else if (s.trace) combine<true, false>(s, a);
                                              else if (a.pull) combine<false, true>(s, a);
                                              else combine<false, false>(s, a);
                                          });
    });
}
