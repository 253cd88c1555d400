// Host entry points of the normal mode's RDMA stage across nodes (docs/normal_internode.md): the
// "relay" moves rows between the ranks of one column -- the ranks with the same local index on every
// node -- over our mlx5 QPs (engine/mlx5gda/qp.h; a real NIC or the softnic). A row for node m goes
// once to rank m*P + local there; the NVLink stage inside a node is the intranode kernels'.
// Plain C++ types only, as normal_launch.h.
#pragma once

#include <stdint.h>

#include "kernels/normal_tags.h"
#include "mlx5gda/portable.h"

namespace pyep {
namespace normal {

constexpr int kMaxNodes = 32;
#if defined(PYEP_LL_CPU_SIM) && defined(PYEP_LL_THREADS)
constexpr int kRelayThreads = PYEP_LL_THREADS;   // CPU simulation (tests/ll_sim): fewer threads per block
#else
constexpr int kRelayThreads = 256;
#endif
constexpr int kRelayWarps = kRelayThreads / 32;

// Codes beyond NormalError (errors.py ERR_QP), and the relay's phases (errors.py PHASES).
enum RelayError : int { kErrQp = 5 };   // a = peer rank, b = syndrome | vendor << 8 | kind << 16, c = qpn
enum RelayPhase : int { kPhaseRdmaCounts = 3, kPhaseRdmaDispatch = 4, kPhaseRdmaCombine = 5 };

// Fixed for the lifetime of one buffer. Word offsets (int32) and byte offsets into `buf`, which every
// column peer registered with its NIC (pyep/ep/normal/internode_layout.py defines them).
struct RelayStatic {
    int node = 0, num_nodes = 0;  // this rank's node; M
    int ranks_per_node = 1, local = 0;  // P; the column: rank m*P + local on node m
    uint64_t buf = 0;             // this rank's relay buffer (device memory, NIC-registered)
    uint64_t remote_addr = 0;     // device uint64[M]: node m's column peer's buffer as its MR sees it
    uint64_t rkeys = 0;           // device uint32[M]
    uint32_t lkey = 0;
    uint64_t qps = 0;             // gda::Qp[M * num_qps_per_peer] (entries of this node unused)
    int num_qps_per_peer = 1;
    // u32 tail[M]: rows node m's peer published into my ring m (its atomics); u32 head[M]: rows node m's
    // peer consumed from my stream (its atomics); u32 tx[M], rx[M]: my own counts; u64 count[2][M]: the
    // row count node m's peer sends me in call `seq` ((seq << 32) | rows, by call parity); u64
    // outbox[2][M]: the same records as I send them (the NIC reads them from here).
    uint32_t off_tail = 0, off_head = 0, off_tx = 0, off_rx = 0, off_count = 0, off_outbox = 0, off_fetch = 0;
    uint64_t off_send = 0, off_recv = 0;   // bytes: staging rings [M] and receive rings [M]
    uint64_t ring_bytes = 0;      // bytes of one ring (send and receive rings alike)
    uint64_t err = 0;             // pinned int32[8]: the error record (normal_common.cuh record_error)
    uint64_t workspace = 0;       // device int32[8]: the kWs* words of normal_tags.h (call number of the
                                  // last count exchange, generation, void flag and origin, error claim);
                                  // zeroed by clean() only
    uint64_t timeout_ns = 0;
    uint64_t tag_record = 0;      // pinned int32[kTagRecordInts]: the node buffer's (one record per rank)
    // device int32[R]: the buffer's mask (docs/elastic.md, "Normal mode"), or 0. With a mask a column
    // peer out of it is neither sent to nor waited for, and one silent past the timeout (or whose QP
    // fails) is marked: its entry cleared here and its bit in the workspace's kWsMask word (bit m = node
    // m's column peer in the latest call), and the call goes on without it.
    uint64_t active = 0;
};

// ---- the count exchange's call number ----------------------------------------------------------------
// The call number lives in device memory and the counts kernel advances it (normal_tags.h next_call), so
// a CUDA graph that captured a count exchange is a new call at every replay (the launch arguments are
// replayed as captured); every column peer makes the same calls in the same order, and the records
// carry the number (and 6 bits of the generation, and the call's status: normal_tags.h
// relay_count_record) so that a peer at another call is found, not waited for. It starts at 0 after
// clean() (the count slots are zeroed then too).
constexpr int kRelaySeqWord = kWsSeq;

struct RelayCountsArgs {
    int host_ticket = 0;          // with host_counts: the host's label of this call (> 0), written back
                                  // as +-ticket when the counts are in (never inside a graph capture)
    uint64_t send_counts = 0;     // device int32[M]: rows for node m (this node's entry ignored)
    uint64_t recv_counts = 0;     // out device int32[M + 1]: rows from node m; [M] = sum
    uint64_t host_counts = 0;     // pinned int32[2 + 2M]: [+-host_ticket when ready (negative: read the
                                  // error and tag records), total, rows from node m [M], send_counts [M]
                                  // (this node's entry too)], or 0
    // The column's call gate (normal_gate.cuh does the same inside a node): this rank's status for the
    // call (a refusal on its host: kTagRefused), its global rank, and the workspace of a gate earlier
    // in this call (the node's) whose void it passes on (kTagProxy), or 0. kind names the call in records.
    int kind = kKindDispatch, status = kTagOk, origin = 0;
    uint64_t upstream = 0;
    uint64_t handle_tag = 0;      // device int32[2] of the handle a cached dispatch uses, or 0: a handle of
                                  // a void dispatch (normal_tags.h kHandleVoid) makes the call void here too
};

struct RelayArgs {
    int phase = kPhaseRdmaDispatch;
    uint64_t src = 0;             // rows for the nodes, node by node: rows of node m at send_offsets[m]
    uint64_t send_offsets = 0;    // device int32[M + 1] (exclusive prefix; this node's run is empty)
    uint64_t dst = 0;             // rows from the nodes, node by node at recv_offsets[m]
    uint64_t recv_offsets = 0;    // device int32[M + 1]
    int row_bytes = 0;            // multiple of 16
    int ring_tokens = 0;          // Q: slots of a ring (Q * row_bytes <= ring_bytes)
    int chunk_tokens = 0;         // rows per RDMA write + tail update (<= Q)
    int dst_capacity = 0;         // rows of dst (> 0: rows beyond it are received but not stored)
};

// ---- the staged path's own kernels (normal_internode.cu) ---------------------------------------------
// A relayed dispatch row (node m's forwarder receives one per token with a rank on node m):
// [payload H*elem][FP8 scales, align16][top-k ids int64 x K][weights fp32 x K][source token int32]
// [is_token_in_rank of node m's P ranks, bytes], 16-byte aligned. A cached dispatch relays the
// payload and scales only (full = 0: K, source and ranks are in the handle).
PYEP_HD uint32_t align_16(uint32_t v) { return (v + 15u) / 16u * 16u; }
struct RelayRow {
    uint32_t payload, scales, ids, weights, src, in_rank, bytes;
    PYEP_HD RelayRow(int hidden, int fp8, int k, int p, int full) {
        payload = fp8 ? hidden : 2 * hidden;
        scales = payload;
        ids = align_16(payload + (fp8 ? 4u * (hidden / 128) : 0u));
        weights = ids + (full ? 8u * k : 0u);
        src = weights + (full ? 4u * k : 0u);
        in_rank = src + (full ? 4u : 0u);
        bytes = align_16(in_rank + (full ? (uint32_t)p : 0u));
    }
};

// What every staged-path kernel needs to know about the group.
struct InterStatic {
    int rank = 0, num_ranks = 0;  // global rank, R = M * P
    int node = 0, num_nodes = 0, ranks_per_node = 0;
    uint64_t err = 0, workspace = 0;   // the node buffer's error record and claim (normal_common.cuh)
    // device int32[R]: the buffer's mask (docs/elastic.md, "Normal mode"), or 0. The kernels before the
    // count exchange read it as the call's snapshot: a rank out of it gets no row and its tokens count
    // as dropped. (The mask runs with one rank per node: native_internode.py takes_mask.)
    uint64_t active = 0;
    // The caller's nodes when they differ from the data path's: an elastic buffer on nodes of several
    // ranks runs rank to rank (ranks_per_node 1 here, docs/elastic.md "Across nodes") while its contract
    // keeps the caller's nodes: num_tokens_per_rdma_rank counts them and combine sums a BF16 partial per
    // node of them (contract.combine_order). 0: the data path's nodes.
    int contract_ranks_per_node = 0;
};
PYEP_HD int contract_p(const InterStatic& s) { return s.contract_ranks_per_node > 0 ? s.contract_ranks_per_node : s.ranks_per_node; }

struct InterLayoutArgs {
    uint64_t topk = 0;            // int64 [N, K]
    int num_tokens = 0, num_topk = 0, num_experts = 0;
    uint64_t per_rank = 0, per_expert = 0, per_node = 0, in_rank = 0;   // out int32 [R], [E], [M], bool [N, R]
    uint64_t dropped = 0;         // int32 [R] (zeroed) or 0: tokens routed to a rank out of the mask
};

struct InterRouteArgs {
    uint64_t topk = 0;            // int64 [N, K] or 0: ids outside [-1, E) are recorded
    int num_topk = 0, num_experts = 0;
    uint64_t in_rank = 0;         // bool [N, R]
    int num_tokens = 0, num_channels = 0;
    uint64_t send_head = 0;       // out int32 [N, R]: position in the (channel, -> d) stream
    uint64_t channel_prefix = 0;  // out int32 [R, C]: inclusive prefix over channels
    uint64_t node_head = 0;       // out int32 [N, M]: position in the column stream to node m, or -1
    uint64_t node_counts = 0;     // out int32 [M]: tokens with a rank on node m
    uint64_t meta = 0;            // out int32 [M][meta_ints]: [N, rows for rank d [R]] in every row
    uint64_t meta_own = 0;        // out int32 [meta_ints]: the same record (this node's row of the gather)
    int meta_ints = 0;
    // The caller's layout tensors, values to check against is_token_in_rank and topk_idx (the errors
    // go to the node's record): int32 [R], [M], [E] or 0; check_layout: count topk_idx's entries per
    // expert into layout_scratch (int32 [E], zeroed by the launcher) and compare.
    uint64_t per_rank = 0, per_node = 0, per_expert = 0, layout_scratch = 0;
    int check_layout = 0;
    uint64_t dropped = 0;         // int32 [R] (zeroed) or 0: tokens routed (topk_idx) to a rank out of the mask
};

struct InterOffsetsArgs {
    uint64_t node_counts = 0;     // int32 [M] (this rank's)
    uint64_t recv_counts = 0;     // int32 [M + 1] (relay counts: rows from node m's column peer)
    uint64_t f_offsets = 0;       // out int32 [M + 1]: forwarded rows by source node (own node's too)
    uint64_t s_offsets = 0;       // out int32 [M + 1]: relayed rows by destination node (own node's run empty)
};

struct InterPackArgs {
    uint64_t x = 0, x_scales = 0, topk_idx = 0, topk_weights = 0, in_rank = 0, node_head = 0;
    int num_tokens = 0, hidden = 0, num_topk = 0, fp8 = 0, full = 1;
    uint64_t f_offsets = 0, s_offsets = 0;   // int32 [M + 1]
    uint64_t forward = 0;         // uint8 [f_capacity, row]: this node's own run goes here
    int f_capacity = 0;
    uint64_t send = 0;            // uint8 [., row]: runs for the other nodes
};

// The small fields of the forwarded rows F as the intranode kernels take them (the payload is read in
// place: DispatchArgs::x_row_bytes): ids made node-local (id - node*P*E_l inside the node, else -1),
// and is_token_in_rank cleared past the real rows (f_offsets[M]; F is a bound under num_worst_tokens).
struct InterUnpackArgs {
    uint64_t forward = 0;         // uint8 [rows, RelayRow(full) bytes]
    int rows = 0, hidden = 0, num_topk = 0, fp8 = 0, num_local_experts = 0;
    uint64_t f_offsets = 0;       // int32 [M + 1]
    uint64_t scales = 0, ids = 0, weights = 0;   // out fp32 [rows, H/128], int64 [rows, K], fp32 [rows, K], or 0
    uint64_t src = 0, in_rank = 0;                // out int32 [rows], bool [rows, P]
    // With a mask: the relay's kWsMask word (bit m: node m's column peer stayed in the call). A source
    // node out of it contributes nothing to the call: its run is in no rank and its record (records:
    // int32 [M][record_ints], the count records the column relayed) is zeroed before the node's notify;
    // in every record the rows for the ranks of a node out of it are 0 (nothing went there).
    uint64_t column_mask = 0, records = 0;
    int record_ints = 0;
};

// After a dispatch's relays, with a mask: a node whose column peer left the call during them (the relay's
// kWsMask word) gets nothing more from this call's handle -- node_head[t][m] and send_head[t][d] of its
// ranks -1, their channel_prefix rows 0 -- and this rank's tokens that were going to it count as dropped
// (once: the combine then expects no partial from it).
struct InterSettleArgs {
    uint64_t column_mask = 0;
    uint64_t node_head = 0, send_head = 0, channel_prefix = 0;   // int32 [N, M], [N, R], [R, C]
    int num_tokens = 0, num_channels = 0;
    uint64_t dropped = 0;         // int32 [R] or 0
};

// Zero the forwarded rows of the source nodes out of the call (a cached dispatch with a mask: its handle
// places their rows, which arrive emptied, as the intranode kernels empty a source marked mid-stream).
struct InterEmptyArgs {
    uint64_t forward = 0;         // uint8 [rows, row_bytes]
    int rows = 0, row_bytes = 0;
    uint64_t f_offsets = 0;       // int32 [M + 1]
    uint64_t column_mask = 0;     // the relay's kWsMask word
};

struct InterReduceArgs {
    uint64_t node_head = 0, f_offsets = 0, s_offsets = 0;
    uint64_t own = 0, own_weights = 0;   // bf16 [F, H], fp32 [F, K]: this node's partials (forwarder rows)
    uint64_t recv = 0;            // uint8 [., row]: partials from the other nodes, [bf16 H][fp32 K] rows
    int row_bytes = 0;
    uint64_t bias0 = 0, bias1 = 0;
    int num_tokens = 0, hidden = 0, num_topk = 0;
    uint64_t out = 0, out_weights = 0;
    // With a mask: the relay's kWsMask word after the partials came back; a node out of it adds nothing
    // and each token that had a row there counts as dropped for that node's rank (one rank per node).
    uint64_t column_mask = 0, dropped = 0;
};

// normal_internode_order.cu: the bookkeeping after the node's notify (inter_order) and after the
// intranode dispatch (inter_recv_prefix). Records: int32 [P][M * meta_ints] as the notify gathered them.
struct OrderArgs {
    uint64_t gathered = 0;
    int meta_ints = 0;
    int rows = 0;                 // inter_order: rows of row_map; inter_recv_prefix: rows of recv_src
    uint64_t row_map = 0;         // out int32 [rows]: intranode kernel row -> contract row
    uint64_t rank_prefix = 0;     // int32 [R, R]: out of inter_order, in of inter_recv_prefix
    uint64_t host_counts = 0;     // pinned int32 [1 + E/R] or 0: [ticket when ready, aligned per-expert counts]
    int host_ticket = 0, num_experts = 0, alignment = 1;
    uint64_t recv_src = 0;        // int32 [rows]: the received rows' source token indices
    int num_channels = 0;
    uint64_t recv_channel_prefix = 0;   // out int32 [R, C]
};

void launch_inter_layout(const InterStatic& s, const InterLayoutArgs& a, uint64_t stream);
void launch_inter_route(const InterStatic& s, const InterRouteArgs& a, uint64_t stream);
void launch_inter_offsets(const InterStatic& s, const InterOffsetsArgs& a, uint64_t stream);
void launch_inter_pack(const InterStatic& s, const InterPackArgs& a, uint64_t stream);
void launch_inter_reduce(const InterStatic& s, const InterReduceArgs& a, uint64_t stream);
void launch_inter_unpack(const InterStatic& s, const InterUnpackArgs& a, uint64_t stream);
void launch_inter_empty(const InterStatic& s, const InterEmptyArgs& a, uint64_t stream);
void launch_inter_settle(const InterStatic& s, const InterSettleArgs& a, uint64_t stream);
void launch_inter_order(const InterStatic& s, const OrderArgs& a, uint64_t stream);
void launch_inter_recv_prefix(const InterStatic& s, const OrderArgs& a, uint64_t stream);

void launch_relay_counts(const RelayStatic& s, const RelayCountsArgs& a, uint64_t stream);
void launch_relay(const RelayStatic& s, const RelayArgs& a, uint64_t stream);

}  // namespace normal
}  // namespace pyep
