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

// The staged path's kernels (normal_internode.cu): arguments by keyword, pointers as ints.
void register_staged(py::module_& n) {
    py::class_<InterStatic>(n, "InterStatic")
        .def(py::init<>())
        .def_readwrite("rank", &InterStatic::rank)
        .def_readwrite("num_ranks", &InterStatic::num_ranks)
        .def_readwrite("node", &InterStatic::node)
        .def_readwrite("num_nodes", &InterStatic::num_nodes)
        .def_readwrite("ranks_per_node", &InterStatic::ranks_per_node)
        .def_readwrite("err", &InterStatic::err)
        .def_readwrite("workspace", &InterStatic::workspace)
        .def_readwrite("active", &InterStatic::active)
        .def_readwrite("contract_ranks_per_node", &InterStatic::contract_ranks_per_node);
    n.def(
        "relay_row",
        [](int hidden, bool fp8, int k, int p, bool full) {
            const RelayRow r(hidden, fp8, k, p, full);
            py::dict d;
            d["payload"] = r.payload;
            d["scales"] = r.scales;
            d["ids"] = r.ids;
            d["weights"] = r.weights;
            d["src"] = r.src;
            d["in_rank"] = r.in_rank;
            d["bytes"] = r.bytes;
            return d;
        },
        py::arg("hidden"), py::arg("fp8"), py::arg("num_topk"), py::arg("ranks_per_node"), py::arg("full"),
        "byte offsets of the fields of a relayed dispatch row");
    n.def(
        "layout",
        [](const InterStatic& s, uint64_t topk, int num_tokens, int num_topk, int num_experts, uint64_t per_rank,
           uint64_t per_expert, uint64_t per_node, uint64_t in_rank, uint64_t stream, uint64_t dropped) {
            InterLayoutArgs a;
            a.dropped = dropped;
            a.topk = topk;
            a.num_tokens = num_tokens;
            a.num_topk = num_topk;
            a.num_experts = num_experts;
            a.per_rank = per_rank;
            a.per_expert = per_expert;
            a.per_node = per_node;
            a.in_rank = in_rank;
            launch_inter_layout(s, a, stream);
        },
        "get_dispatch_layout for ranks of several nodes");
    n.def(
        "route",
        [](const InterStatic& s, uint64_t topk, int num_topk, int num_experts, uint64_t in_rank, int num_tokens,
           int num_channels, uint64_t send_head, uint64_t channel_prefix, uint64_t node_head, uint64_t node_counts,
           uint64_t meta, uint64_t meta_own, int meta_ints, uint64_t stream, uint64_t per_rank, uint64_t per_node,
           uint64_t per_expert, uint64_t layout_scratch, int check_layout, uint64_t dropped) {
            InterRouteArgs a;
            a.dropped = dropped;
            a.per_rank = per_rank;
            a.per_node = per_node;
            a.per_expert = per_expert;
            a.layout_scratch = layout_scratch;
            a.check_layout = check_layout;
            a.topk = topk;
            a.num_topk = num_topk;
            a.num_experts = num_experts;
            a.in_rank = in_rank;
            a.num_tokens = num_tokens;
            a.num_channels = num_channels;
            a.send_head = send_head;
            a.channel_prefix = channel_prefix;
            a.node_head = node_head;
            a.node_counts = node_counts;
            a.meta = meta;
            a.meta_own = meta_own;
            a.meta_ints = meta_ints;
            launch_inter_route(s, a, stream);
        },
        "send_head, channel prefix, node streams and the count record of a staged dispatch; the caller's layout "
        "tensors checked against is_token_in_rank and topk_idx");
    n.def(
        "offsets",
        [](const InterStatic& s, uint64_t node_counts, uint64_t recv_counts, uint64_t f_offsets, uint64_t s_offsets,
           uint64_t stream) {
            InterOffsetsArgs a;
            a.node_counts = node_counts;
            a.recv_counts = recv_counts;
            a.f_offsets = f_offsets;
            a.s_offsets = s_offsets;
            launch_inter_offsets(s, a, stream);
        },
        "run offsets of the forwarded and relayed rows");
    n.def(
        "pack",
        [](const InterStatic& s, uint64_t x, uint64_t x_scales, uint64_t topk_idx, uint64_t topk_weights,
           uint64_t in_rank, uint64_t node_head, int num_tokens, int hidden, int num_topk, bool fp8, bool full,
           uint64_t f_offsets, uint64_t s_offsets, uint64_t forward, int f_capacity, uint64_t send, uint64_t stream) {
            InterPackArgs a;
            a.x = x;
            a.x_scales = x_scales;
            a.topk_idx = topk_idx;
            a.topk_weights = topk_weights;
            a.in_rank = in_rank;
            a.node_head = node_head;
            a.num_tokens = num_tokens;
            a.hidden = hidden;
            a.num_topk = num_topk;
            a.fp8 = fp8;
            a.full = full;
            a.f_offsets = f_offsets;
            a.s_offsets = s_offsets;
            a.forward = forward;
            a.f_capacity = f_capacity;
            a.send = send;
            launch_inter_pack(s, a, stream);
        },
        "relay rows of a staged dispatch");
    n.def(
        "reduce",
        [](const InterStatic& s, uint64_t node_head, uint64_t f_offsets, uint64_t s_offsets, uint64_t own,
           uint64_t own_weights, uint64_t recv, int row_bytes, uint64_t bias0, uint64_t bias1, int num_tokens,
           int hidden, int num_topk, uint64_t out, uint64_t out_weights, uint64_t stream, uint64_t column_mask,
           uint64_t dropped) {
            InterReduceArgs a;
            a.column_mask = column_mask;
            a.dropped = dropped;
            a.node_head = node_head;
            a.f_offsets = f_offsets;
            a.s_offsets = s_offsets;
            a.own = own;
            a.own_weights = own_weights;
            a.recv = recv;
            a.row_bytes = row_bytes;
            a.bias0 = bias0;
            a.bias1 = bias1;
            a.num_tokens = num_tokens;
            a.hidden = hidden;
            a.num_topk = num_topk;
            a.out = out;
            a.out_weights = out_weights;
            launch_inter_reduce(s, a, stream);
        },
        "the final combine sum at the source: bias, then every node's partial in node order");
    n.def(
        "unpack",
        [](const InterStatic& s, uint64_t forward, int rows, int hidden, int num_topk, bool fp8, int num_local_experts,
           uint64_t f_offsets, uint64_t scales, uint64_t ids, uint64_t weights, uint64_t src, uint64_t in_rank,
           uint64_t stream, uint64_t column_mask, uint64_t records, int record_ints) {
            InterUnpackArgs a;
            a.column_mask = column_mask;
            a.records = records;
            a.record_ints = record_ints;
            a.forward = forward;
            a.rows = rows;
            a.hidden = hidden;
            a.num_topk = num_topk;
            a.fp8 = fp8;
            a.num_local_experts = num_local_experts;
            a.f_offsets = f_offsets;
            a.scales = scales;
            a.ids = ids;
            a.weights = weights;
            a.src = src;
            a.in_rank = in_rank;
            launch_inter_unpack(s, a, stream);
        },
        "the forwarded rows' scales, node-local ids, weights, source indices and ranks, in one pass");
    n.def(
        "settle",
        [](const InterStatic& s, uint64_t column_mask, uint64_t node_head, uint64_t send_head, uint64_t channel_prefix,
           int num_tokens, int num_channels, uint64_t dropped, uint64_t stream) {
            InterSettleArgs a;
            a.column_mask = column_mask;
            a.node_head = node_head;
            a.send_head = send_head;
            a.channel_prefix = channel_prefix;
            a.num_tokens = num_tokens;
            a.num_channels = num_channels;
            a.dropped = dropped;
            launch_inter_settle(s, a, stream);
        },
        "after a dispatch's relays: nothing more for the nodes that left the call, their tokens dropped");
    n.def(
        "empty",
        [](const InterStatic& s, uint64_t forward, int rows, int row_bytes, uint64_t f_offsets, uint64_t column_mask,
           uint64_t stream) {
            InterEmptyArgs a;
            a.forward = forward;
            a.rows = rows;
            a.row_bytes = row_bytes;
            a.f_offsets = f_offsets;
            a.column_mask = column_mask;
            launch_inter_empty(s, a, stream);
        },
        "zero the forwarded rows of source nodes out of the call (a cached dispatch with a mask)");
    n.def(
        "order",
        [](const InterStatic& s, uint64_t gathered, int meta_ints, int rows, uint64_t row_map, uint64_t rank_prefix,
           uint64_t host_counts, int host_ticket, int num_experts, int alignment, uint64_t stream) {
            OrderArgs a;
            a.gathered = gathered;
            a.meta_ints = meta_ints;
            a.rows = rows;
            a.row_map = row_map;
            a.rank_prefix = rank_prefix;
            a.host_counts = host_counts;
            a.host_ticket = host_ticket;
            a.num_experts = num_experts;
            a.alignment = alignment;
            launch_inter_order(s, a, stream);
        },
        "row map, rank_prefix_matrix and (to pinned words) per-expert counts from the gathered records");
    n.def(
        "recv_prefix",
        [](const InterStatic& s, uint64_t gathered, int meta_ints, uint64_t rank_prefix, uint64_t recv_src, int rows,
           int num_channels, uint64_t recv_channel_prefix, uint64_t stream) {
            OrderArgs a;
            a.gathered = gathered;
            a.meta_ints = meta_ints;
            a.rank_prefix = rank_prefix;
            a.recv_src = recv_src;
            a.rows = rows;
            a.num_channels = num_channels;
            a.recv_channel_prefix = recv_channel_prefix;
            launch_inter_recv_prefix(s, a, stream);
        },
        "recv_channel_prefix_matrix from the received rows' source indices");
}

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
        .def_readwrite("timeout_ns", &RelayStatic::timeout_ns)
        .def_readwrite("tag_record", &RelayStatic::tag_record)
        .def_readwrite("active", &RelayStatic::active);
    n.attr("MAX_NODES") = kMaxNodes;
    n.attr("QP_CONTEXT_SIZE") = sizeof(pyep::gda::Qp);
    n.attr("PHASE_COUNTS") = (int)kPhaseRdmaCounts;
    n.attr("PHASE_DISPATCH") = (int)kPhaseRdmaDispatch;
    n.attr("PHASE_COMBINE") = (int)kPhaseRdmaCombine;
    n.attr("RELAY_SEQ_WORD") = kRelaySeqWord;
    n.def(
        "counts",
        [](const RelayStatic& s, int host_ticket, uint64_t send_counts, uint64_t recv_counts, uint64_t host_counts,
           uint64_t stream, int kind, int status, int origin, uint64_t upstream, uint64_t handle_tag) {
            RelayCountsArgs a;
            a.handle_tag = handle_tag;
            a.host_ticket = host_ticket;
            a.send_counts = send_counts;
            a.recv_counts = recv_counts;
            a.host_counts = host_counts;
            a.kind = kind;
            a.status = status;
            a.origin = origin;
            a.upstream = upstream;
            launch_relay_counts(s, a, stream);
        },
        py::arg("static"), py::arg("host_ticket"), py::arg("send_counts"), py::arg("recv_counts"), py::arg("host_counts"),
        py::arg("stream"), py::arg("kind"), py::arg("status"), py::arg("origin"), py::arg("upstream"),
        py::arg("handle_tag") = 0,
        "exchange this call's row counts with the column peers, the column's call gate (RDMA writes of "
        "normal_tags.h relay_count_record: the device's call number, generation, status, rows)");
    n.def(
        "relay",
        [](const RelayStatic& s, int phase, uint64_t src, uint64_t send_offsets, uint64_t dst, uint64_t recv_offsets,
           int row_bytes, int ring_tokens, int chunk_tokens, int dst_capacity, uint64_t stream) {
            RelayArgs a;
            a.phase = phase;
            a.src = src;
            a.send_offsets = send_offsets;
            a.dst = dst;
            a.recv_offsets = recv_offsets;
            a.row_bytes = row_bytes;
            a.ring_tokens = ring_tokens;
            a.chunk_tokens = chunk_tokens;
            a.dst_capacity = dst_capacity;
            launch_relay(s, a, stream);
        },
        "move rows to / from the column peers through the bounded RDMA rings");
    register_staged(n);
}

pyep::bindings::Registrar reg("relay", &register_relay);

}  // namespace
#endif  // PYEP_WITH_CUDA
