// pyep._engine part "normal": the normal-mode (high-throughput) intranode kernels. CUDA builds only.
// One binding call per launch; pointers and the stream cross as Python ints (tensor.data_ptr(),
// the raw current stream), so the launches stay CUDA-graph capturable.
#if defined(PYEP_WITH_CUDA)
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bindings/registry.h"
#include "kernels/normal_launch.h"

namespace py = pybind11;
using namespace pyep::normal;

namespace {

void register_normal(py::module_& m) {
    auto n = m.def_submodule("normal", "Normal-mode dispatch/combine kernels (pyep.ep.normal.native drives them)");
    py::class_<NormalStatic>(n, "NormalStatic")
        .def(py::init<>())
        .def_readwrite("rank", &NormalStatic::rank)
        .def_readwrite("num_ranks", &NormalStatic::num_ranks)
        .def_readwrite("buf", &NormalStatic::buf)
        .def_readwrite("peer_base", &NormalStatic::peer_base)
        .def_readwrite("ring_off", &NormalStatic::ring_off)
        .def_readwrite("ring_capacity", &NormalStatic::ring_capacity)
        .def_readwrite("slot_bytes", &NormalStatic::slot_bytes)
        .def_readwrite("off_tail", &NormalStatic::off_tail)
        .def_readwrite("off_head", &NormalStatic::off_head)
        .def_readwrite("off_tx", &NormalStatic::off_tx)
        .def_readwrite("off_rx", &NormalStatic::off_rx)
        .def_readwrite("off_flag", &NormalStatic::off_flag)
        .def_readwrite("off_notify", &NormalStatic::off_notify)
        .def_readwrite("off_alive", &NormalStatic::off_alive)
        .def_readwrite("notify_ints", &NormalStatic::notify_ints)
        .def_readwrite("err", &NormalStatic::err)
        .def_readwrite("host_counts", &NormalStatic::host_counts)
        .def_readwrite("workspace", &NormalStatic::workspace)
        .def_readwrite("timeout_ns", &NormalStatic::timeout_ns)
        .def_readwrite("tag_record", &NormalStatic::tag_record)
        .def_readwrite("global_base", &NormalStatic::global_base)
        .def_readwrite("layout_scratch", &NormalStatic::layout_scratch)
        .def_readwrite("active", &NormalStatic::active)
        .def_readwrite("off_direct", &NormalStatic::off_direct)
        .def_readwrite("off_pulled", &NormalStatic::off_pulled)
        .def_readwrite("pool_lo", &NormalStatic::pool_lo)
        .def_readwrite("pool_hi", &NormalStatic::pool_hi)
        .def_readwrite("trace", &NormalStatic::trace);
    n.attr("MAX_CHANNELS") = kMaxChannels;
    n.attr("DESC_INTS") = kDescInts;
    n.attr("MAX_RANKS") = kMaxRanks;
    n.attr("MAX_LOCAL_EXPERTS") = kMaxLocalExperts;
    n.attr("NOTIFY_EXTRA") = kNotifyExtra;
    n.attr("DISPATCH_THREADS") = kDispatchThreads;
    n.attr("COMBINE_THREADS") = kCombineThreads;
    n.attr("TRACE_WORDS") = kTraceWords;   // normal_trace.cuh: uint64 words per block of a traced combine
    n.def("dispatch_row_bytes", &dispatch_row_bytes, py::arg("hidden"), py::arg("fp8"), py::arg("num_topk"));
    n.def("combine_row_bytes", &combine_row_bytes, py::arg("hidden"), py::arg("num_topk"));

    n.def(
        "layout",
        [](const NormalStatic& s, uint64_t topk, int num_tokens, int num_topk, int num_experts, uint64_t per_rank,
           uint64_t per_expert, uint64_t in_rank, uint64_t stream, uint64_t dropped) {
            LayoutArgs a;
            a.dropped = dropped;
            a.topk = topk;
            a.num_tokens = num_tokens;
            a.num_topk = num_topk;
            a.num_experts = num_experts;
            a.num_tokens_per_rank = per_rank;
            a.num_tokens_per_expert = per_expert;
            a.is_token_in_rank = in_rank;
            launch_layout(s, a, stream);
        },
        py::arg("static"), py::arg("topk"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"),
        py::arg("per_rank"), py::arg("per_expert"), py::arg("in_rank"), py::arg("stream"), py::arg("dropped") = 0,
        "get_dispatch_layout's kernel (dropped: device int32 [R] or 0, tokens routed to inactive ranks)");

    // The notify kernel's arguments (routing, counts and the call tag; gate_only: the tag alone).
    py::class_<NotifyArgs>(n, "NotifyArgs")
        .def(py::init<>())
        .def_readwrite("topk", &NotifyArgs::topk)
        .def_readwrite("num_topk", &NotifyArgs::num_topk)
        .def_readwrite("num_tokens_per_rank", &NotifyArgs::num_tokens_per_rank)
        .def_readwrite("num_tokens_per_expert", &NotifyArgs::num_tokens_per_expert)
        .def_readwrite("is_token_in_rank", &NotifyArgs::is_token_in_rank)
        .def_readwrite("num_tokens", &NotifyArgs::num_tokens)
        .def_readwrite("num_experts", &NotifyArgs::num_experts)
        .def_readwrite("num_channels", &NotifyArgs::num_channels)
        .def_readwrite("expert_alignment", &NotifyArgs::expert_alignment)
        .def_readwrite("num_worst_tokens", &NotifyArgs::num_worst_tokens)
        .def_readwrite("rank_prefix_matrix", &NotifyArgs::rank_prefix_matrix)
        .def_readwrite("channel_prefix_matrix", &NotifyArgs::channel_prefix_matrix)
        .def_readwrite("recv_channel_prefix_matrix", &NotifyArgs::recv_channel_prefix_matrix)
        .def_readwrite("send_head", &NotifyArgs::send_head)
        .def_readwrite("extra", &NotifyArgs::extra)
        .def_readwrite("extra_out", &NotifyArgs::extra_out)
        .def_readwrite("extra_ints", &NotifyArgs::extra_ints)
        .def_readwrite("gate_only", &NotifyArgs::gate_only)
        .def_readwrite("kind", &NotifyArgs::kind)
        .def_readwrite("status", &NotifyArgs::status)
        .def_readwrite("handle_tag", &NotifyArgs::handle_tag)
        .def_readwrite("tag_out", &NotifyArgs::tag_out)
        .def_readwrite("upstream", &NotifyArgs::upstream)
        .def_readwrite("check_layout", &NotifyArgs::check_layout)
        .def_readwrite("dropped", &NotifyArgs::dropped)
        .def_readwrite("pull_offer", &NotifyArgs::pull_offer)
        .def_readwrite("pull_rows", &NotifyArgs::pull_rows)
        .def_readwrite("pull_x", &NotifyArgs::pull_x)
        .def_property(
            "sig", [](const NotifyArgs& a) { return std::vector<int>(a.sig, a.sig + kTagSigHandle); },
            [](NotifyArgs& a, const std::vector<int>& v) {
                if (v.size() > (size_t)kTagSigHandle) throw py::value_error("sig holds at most 6 words");
                for (int i = 0; i < kTagSigHandle; ++i) a.sig[i] = i < (int)v.size() ? v[i] : 0;
            })
        .def_property(
            "reason", [](const NotifyArgs& a) { return py::bytes(a.reason, a.reason_len); },
            [](NotifyArgs& a, const py::bytes& b) {
                const std::string v = b;
                if (v.size() > (size_t)kTagReasonBytes) throw py::value_error("reason holds at most 128 bytes");
                std::fill(a.reason, a.reason + kTagReasonBytes, 0);
                std::copy(v.begin(), v.end(), a.reason);
                a.reason_len = (int)v.size();
            });
    n.attr("TAG_RECORD_INTS") = kTagRecordInts;
    n.attr("LAYOUT_SCRATCH_INTS") = kMaxRanks * kMaxLocalExperts;
    n.def("notify", &launch_notify, py::arg("static"), py::arg("args"), py::arg("stream"),
          "Routing per channel, the count exchange and the call gate of a (non-cached) dispatch; with "
          "args.gate_only the call gate alone");

    n.def(
        "dispatch",
        [](const NormalStatic& s, uint64_t x, uint64_t x_scales, uint64_t topk_idx, uint64_t topk_weights,
           uint64_t in_rank, uint64_t rank_prefix, uint64_t channel_prefix, uint64_t recv_channel_prefix,
           int num_tokens, int hidden, int num_topk, int num_local_experts, bool fp8, int num_channels,
           int ring_tokens, int chunk_tokens, int num_out_rows, int num_worst_tokens, int use_tma, uint64_t recv_x,
           uint64_t recv_x_scales, uint64_t recv_topk_idx, uint64_t recv_topk_weights, uint64_t recv_src_idx,
           uint64_t src_idx, uint64_t row_map, uint64_t stream, uint64_t x_row_bytes, uint64_t dropped,
           uint64_t send_head, int64_t scale_token_stride, int64_t scale_group_stride, bool direct,
           bool direct_offer, uint64_t direct_stage) {
            DispatchArgs a;
            a.direct = direct;
            a.direct_offer = direct_offer;
            a.direct_stage = direct_stage;
            a.scale_token_stride = scale_token_stride;
            a.scale_group_stride = scale_group_stride;
            a.dropped = dropped;
            a.send_head = send_head;
            a.x = x;
            a.x_scales = x_scales;
            a.topk_idx = topk_idx;
            a.topk_weights = topk_weights;
            a.is_token_in_rank = in_rank;
            a.rank_prefix_matrix = rank_prefix;
            a.channel_prefix_matrix = channel_prefix;
            a.recv_channel_prefix_matrix = recv_channel_prefix;
            a.num_tokens = num_tokens;
            a.hidden = hidden;
            a.num_topk = num_topk;
            a.num_local_experts = num_local_experts;
            a.fp8 = fp8;
            a.num_channels = num_channels;
            a.ring_tokens = ring_tokens;
            a.chunk_tokens = chunk_tokens;
            a.num_out_rows = num_out_rows;
            a.num_worst_tokens = num_worst_tokens;
            a.use_tma = use_tma;
            a.recv_x = recv_x;
            a.recv_x_scales = recv_x_scales;
            a.recv_topk_idx = recv_topk_idx;
            a.recv_topk_weights = recv_topk_weights;
            a.recv_src_idx = recv_src_idx;
            a.src_idx = src_idx;
            a.row_map = row_map;
            a.x_row_bytes = x_row_bytes;
            launch_dispatch(s, a, stream);
        },
        py::arg("static"), py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"), py::arg("topk_weights"),
        py::arg("in_rank"), py::arg("rank_prefix"), py::arg("channel_prefix"), py::arg("recv_channel_prefix"),
        py::arg("num_tokens"), py::arg("hidden"), py::arg("num_topk"), py::arg("num_local_experts"), py::arg("fp8"),
        py::arg("num_channels"), py::arg("ring_tokens"), py::arg("chunk_tokens"), py::arg("num_out_rows"),
        py::arg("num_worst_tokens"), py::arg("use_tma"), py::arg("recv_x"), py::arg("recv_x_scales"),
        py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"), py::arg("src_idx"),
        py::arg("row_map"), py::arg("stream"), py::arg("x_row_bytes") = 0, py::arg("dropped") = 0,
        py::arg("send_head") = 0, py::arg("scale_token_stride") = -1, py::arg("scale_group_stride") = -1,
        py::arg("direct") = false, py::arg("direct_offer") = false, py::arg("direct_stage") = 0,
        "Launch the dispatch kernel (use_tma: normal_tma.cuh kTmaLocal | kTmaPeer, the row copies by bulk copy; "
        "x_row_bytes: payload stride, 0 = dense; dropped: device int32 [R] or 0; "
        "send_head: the routing positions whose rows a mask drops are cleared, or 0; scale_*_stride: x_scales' "
        "strides in floats, -1 = row-major; direct: the one-copy handshake, direct_offer: the outputs and "
        "direct_stage lie in the output pool)");

    n.def(
        "combine",
        [](const NormalStatic& s, uint64_t x, uint64_t topk_weights, uint64_t bias0, uint64_t bias1,
           uint64_t send_head, uint64_t rank_prefix, uint64_t channel_prefix, uint64_t recv_channel_prefix,
           int num_tokens, int hidden, int num_topk, int num_channels, int ring_tokens, int chunk_tokens,
           uint64_t out, uint64_t out_weights, uint64_t row_map, uint64_t stream, uint64_t dropped, int use_tma,
           int pull) {
            CombineArgs a;
            a.use_tma = use_tma;
            a.pull = pull;
            a.dropped = dropped;
            a.x = x;
            a.topk_weights = topk_weights;
            a.bias0 = bias0;
            a.bias1 = bias1;
            a.send_head = send_head;
            a.rank_prefix_matrix = rank_prefix;
            a.channel_prefix_matrix = channel_prefix;
            a.recv_channel_prefix_matrix = recv_channel_prefix;
            a.num_tokens = num_tokens;
            a.hidden = hidden;
            a.num_topk = num_topk;
            a.num_channels = num_channels;
            a.ring_tokens = ring_tokens;
            a.chunk_tokens = chunk_tokens;
            a.out = out;
            a.out_weights = out_weights;
            a.row_map = row_map;
            launch_combine(s, a, stream);
        },
        py::arg("static"), py::arg("x"), py::arg("topk_weights"), py::arg("bias0"), py::arg("bias1"),
        py::arg("send_head"), py::arg("rank_prefix"), py::arg("channel_prefix"), py::arg("recv_channel_prefix"),
        py::arg("num_tokens"), py::arg("hidden"), py::arg("num_topk"), py::arg("num_channels"), py::arg("ring_tokens"),
        py::arg("chunk_tokens"), py::arg("out"), py::arg("out_weights"), py::arg("row_map"), py::arg("stream"),
        py::arg("dropped") = 0, py::arg("use_tma") = 0, py::arg("pull") = 0,
        "Launch the combine kernel (dropped: device int32 [R] or 0; use_tma: normal_tma.cuh kTmaPeer, rows into "
        "peers' rings by bulk copy, | kTmaLocal, the reduce's rows loaded by bulk copy; 0 = warp loads/stores; "
        "pull: this rank offered x for pulling in the call's gate, normal_pull.cuh)");
}

pyep::bindings::Registrar reg("normal", &register_normal);

}  // namespace
#endif  // PYEP_WITH_CUDA
