// Host entry points of the normal mode's RDMA stage across nodes (docs/normal_internode.md): the
// "relay" moves rows between the ranks of one column -- the ranks with the same local index on every
// node -- over our mlx5 QPs (engine/mlx5gda/qp.h; a real NIC or the softnic). A row for node m goes
// once to rank m*P + local there; the NVLink stage inside a node is the intranode kernels'.
// Plain C++ types only, as normal_launch.h.
#pragma once

#include <stdint.h>

namespace pyep {
namespace normal {

constexpr int kMaxNodes = 32;
constexpr int kRelayThreads = 256;
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
    uint64_t workspace = 0;       // device int32[8]: [4] error claim
    uint64_t timeout_ns = 0;
};

struct RelayCountsArgs {
    int seq = 0;                  // call number (from 1)
    uint64_t send_counts = 0;     // device int32[M]: rows for node m (this node's entry ignored)
    uint64_t recv_counts = 0;     // out device int32[M + 1]: rows from node m; [M] = sum
    uint64_t host_counts = 0;     // pinned int32[2 + M]: [seq when ready, total, per node], or 0
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
};

void launch_relay_counts(const RelayStatic& s, const RelayCountsArgs& a, uint64_t stream);
void launch_relay(const RelayStatic& s, const RelayArgs& a, uint64_t stream);

}  // namespace normal
}  // namespace pyep
