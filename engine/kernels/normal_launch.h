// Host entry points of the normal-mode (high-throughput) intranode kernels: the layout kernel, the
// per-call routing and count exchange (notify), and the channel-based dispatch and combine over
// NVLink-mapped ring buffers. Plain C++ types only (pointers and streams travel as uint64), so the
// pybind11 layer needs no CUDA headers. pyep/ep/normal/layout.py defines the buffer layout whose
// offsets arrive in NormalStatic; docs/normal_mode.md explains the protocol.
#pragma once

#include <stdint.h>

#include "kernels/normal_tags.h"

namespace pyep {
namespace normal {

constexpr int kMaxChannels = 64;        // pyep/ep/normal/limits.py MAX_CHANNELS
constexpr int kMaxRanks = 8;            // config.py MAX_RANKS: one NVLink domain
constexpr int kMaxTopk = 16;
constexpr int kMaxLocalExperts = 1024;
// Notify slot fields: [kMaxRanks] rows per rank, [kMaxChannels] per channel, [kMaxLocalExperts] per
// expert, the call tag (normal_tags.h), then the extra words of an internode call (layout.py
// NOTIFY_INTS is this offset).
constexpr int kNotifyTag = kMaxRanks + kMaxChannels + kMaxLocalExperts;
constexpr int kNotifyExtra = kNotifyTag + kTagInts;
// Block sizes. Dispatch: 24 warps (copies need many stores in flight; 80 registers a thread suffice).
// Combine: 16 warps, so that a reduce may keep 8 loads per lane in flight in 128 registers.
#if defined(PYEP_LL_CPU_SIM) && defined(PYEP_LL_THREADS)
constexpr int kDispatchThreads = 2 * PYEP_LL_THREADS;   // CPU simulation (tests/ll_sim): fewer OS threads
constexpr int kCombineThreads = 2 * PYEP_LL_THREADS;
#else
constexpr int kDispatchThreads = 768;
constexpr int kCombineThreads = 512;
#endif
constexpr int kDispatchWarps = kDispatchThreads / 32;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kScanWindow = 32;         // tokens per routing ballot
constexpr int kMaxWindows = 4;          // ballots per dispatch-sender round (bounded by ring_tokens / 32)

// Device error record (pinned host memory, int32 words): [code, a, b, c]. errors.py decodes it (5 is
// the relay's kErrQp).
enum NormalError : int {
    kErrNone = 0, kErrExpertId = 1, kErrWorstTokens = 2, kErrPeerTimeout = 3, kErrBadHandle = 4,
    kErrInRank = 6,        // a = token, b = rank, c = is_token_in_rank's value: contradicts topk_idx
    kErrExpertCount = 7,   // a = expert, b = num_tokens_per_expert's value, c = entries naming it (-1: unknown)
    kErrRankCount = 8,     // a = rank, b = num_tokens_per_rank's value, c = rows is_token_in_rank gives
    kErrNodeCount = 9,     // a = node, b = num_tokens_per_rdma_rank's value, c = tokens is_token_in_rank gives
    kErrVoidHandle = 10,   // a = the call number of the void dispatch whose handle this call used
    kErrDirectDesc = 11,   // a = rank, b = which field (1 rows, 2 recv_x, 3 scales, 4 staging), c = its rows:
                           // a one-copy output descriptor outside the pool (normal_direct.cuh); b = 5 (its
                           // rows) or 6 (x): a pull combine's input descriptor (normal_pull.cuh)
    kErrLostPath = 12,     // a = rank, b = the call number: the ring kernel found no path of this call
                           // recorded by the one-copy kernel (normal_direct.cuh recorded_path)
};

// One-copy dispatch (normal_direct.cuh): int32 words of a channel's output descriptor, and the bytes of
// a staging row (top-k ids as int32, weights, the source index) per output row.
constexpr int kDescInts = 16;
constexpr uint32_t stage_row_bytes(int num_topk) { return 8u * (uint32_t)num_topk + 4u; }
enum Phase : int { kPhaseNotify = 0, kPhaseDispatch = 1, kPhaseCombine = 2 };
// Kernel trace (normal_trace.cuh): uint64 words per block of a traced combine (2 x num_channels blocks):
// the first clock reading of its warps (ns, stored complemented) and the last, the warps' summed time
// waiting on peer counters, moving rows and at barriers, the rows (senders) or tokens (reducers) moved,
// the warps that reported, the role.
enum TraceWord : int {
    kTraceStart = 0, kTraceEnd = 1, kTraceWait = 2, kTraceWork = 3, kTraceSync = 4, kTraceItems = 5,
    kTraceWarps = 6, kTraceRole = 7,
};
constexpr int kTraceWords = 8;
enum TraceRole : int { kTraceRoleNone = 0, kTraceRoleSend = 1, kTraceRoleReduce = 2 };

// What stays fixed for the lifetime of one buffer.
struct NormalStatic {
    int rank = 0;
    int num_ranks = 0;            // R (<= kMaxRanks)
    uint64_t buf = 0;             // this rank's buffer
    uint64_t peer_base = 0;       // device uint64[R]: peer r's buffer as mapped here (own buffer for r = rank)
    uint64_t ring_off = 0;        // bytes: start of the rings (layout.py ring_offset)
    uint64_t ring_capacity = 0;   // bytes available for rings
    // Bytes between ring slots: layout.py slot_bytes(H) of the call's hidden H, the same for every row
    // kind, so the rings of two streams never overlap when one call sends FP8 rows and the next BF16 or
    // combine rows. The host changes it (with the ring depth) only after every rank is idle
    // (native.py _settle_ring_geometry); the launches check that a row fits.
    uint64_t slot_bytes = 0;
    // Word (int32) offsets of the control arrays (layout.py control_words).
    uint32_t off_tail = 0, off_head = 0, off_tx = 0, off_rx = 0, off_flag = 0, off_notify = 0;
    uint32_t off_alive = 0;       // this rank's heartbeat word (normal_common.cuh PeerClock)
    uint32_t notify_ints = 0;     // ints per (parity, source) notify slot
    uint64_t err = 0;             // pinned int32[8]: the error record
    uint64_t host_counts = 0;     // pinned int32[2 + kMaxLocalExperts]: [ready, rows, aligned per-expert rows]
    uint64_t workspace = 0;       // device int32[8]: the kWs* words of normal_tags.h (rows this rank
                                  // receives, call number, generation, void flag, error claim, origin)
    uint64_t timeout_ns = 0;
    uint64_t tag_record = 0;      // pinned int32[kTagRecordInts]: the last void call (normal_tags.h)
    int global_base = 0;          // global rank of local rank 0 (a node of an internode buffer; tags
                                  // and records name global ranks)
    uint64_t layout_scratch = 0;  // device int32[kMaxRanks * kMaxLocalExperts]: per-expert entries of
                                  // topk_idx, counted by the route kernel to check num_tokens_per_expert
    // Device int32[R], 1 = active (docs/elastic.md, "Normal mode"), or 0: no mask. With a mask, calls
    // neither send to nor wait for an inactive rank, and a peer that stays silent past timeout_ns is
    // marked (its entry cleared) and the call completes among the others; without one it voids the call
    // with kErrPeerTimeout.
    uint64_t active = 0;
    // One-copy dispatch (normal_direct.cuh): word offset of the output descriptors (layout.py "direct"),
    // and the output pool, [pool_lo, pool_hi) in bytes from the buffer's start (pool_hi 0: no pool).
    uint32_t off_direct = 0;
    uint64_t pool_lo = 0, pool_hi = 0;
    // Pull combine (normal_pull.cuh): word offset of pulled[2 * kMaxChannels][R] (layout.py "pulled").
    uint32_t off_pulled = 0;
    // Device uint64[2 * kMaxChannels][kTraceWords], or 0: the combine's per-block trace
    // (normal_trace.cuh; PYEP_NORMAL_TRACE). Set: the traced build of the kernel runs.
    uint64_t trace = 0;
};

struct LayoutArgs {
    uint64_t topk = 0;                    // int64 [N, K]
    int num_tokens = 0, num_topk = 0, num_experts = 0;
    uint64_t num_tokens_per_rank = 0;     // out int32 [R]
    uint64_t num_tokens_per_expert = 0;   // out int32 [E]
    uint64_t is_token_in_rank = 0;        // out bool [N, R]
    uint64_t dropped = 0;                 // device int32 [R] or 0: tokens this call did not deliver to rank r
};

struct NotifyArgs {
    uint64_t topk = 0;                    // int64 [N, K] or 0: checked for ids outside [-1, E)
    int num_topk = 0;
    uint64_t num_tokens_per_rank = 0;     // int32 [R]
    uint64_t num_tokens_per_expert = 0;   // int32 [E]
    uint64_t is_token_in_rank = 0;        // bool [N, R]
    int num_tokens = 0, num_experts = 0, num_channels = 0;
    int expert_alignment = 1;
    int num_worst_tokens = 0;
    uint64_t rank_prefix_matrix = 0;      // out int32 [R, R]
    uint64_t channel_prefix_matrix = 0;   // out int32 [R, C]
    uint64_t recv_channel_prefix_matrix = 0;  // out int32 [R, C]
    uint64_t send_head = 0;               // out int32 [N, R]
    // Across nodes (normal_internode.md): `extra_ints` ints of `extra` go to every peer's slot, and
    // extra_out [R][extra_ints] receives what every source sent (0: none).
    uint64_t extra = 0, extra_out = 0;
    int extra_ints = 0;
    // The call tag (normal_tags.h). gate_only: no counts, no routing (a cached dispatch, a combine, or a
    // call refused on the host: status kTagRefused, reason set).
    int gate_only = 0;
    int kind = kKindDispatch, status = kTagOk;
    int sig[kTagSigHandle] = {0, 0, 0, 0, 0, 0};   // the shape words the ranks must agree on
    uint64_t handle_tag = 0;      // device int32[2]: (call, generation) of the handle's dispatch, or 0
    uint64_t tag_out = 0;         // out device int32[2]: this dispatch's (call, generation), or 0
    uint64_t upstream = 0;        // device int32[8]: the workspace of a gate earlier in this call (the
                                  // relay's) whose void this gate passes on (kTagProxy), or 0
    int reason_len = 0;
    char reason[kTagReasonBytes] = {};
    int check_layout = 0;         // check is_token_in_rank and num_tokens_per_expert against topk_idx
    uint64_t dropped = 0;         // device int32 [R] or 0: tokens routed to rank r left out (inactive)
    // A combine's gate: this rank's pull offer (normal_pull.cuh), written where a dispatch's counts go:
    // pull_offer 1 when its combine input x lies in the output pool, pull_x bytes from the buffer's
    // start, pull_rows rows.
    int pull_offer = 0, pull_rows = 0;
    uint64_t pull_x = 0;
};

struct DispatchArgs {
    uint64_t x = 0;                       // bf16 or e4m3 [N, H]
    uint64_t x_scales = 0;                // fp32 [N, H/128] (FP8 only), any strides:
    int64_t scale_token_stride = -1, scale_group_stride = -1;   // in floats; -1: row-major (H/128, 1)
    uint64_t topk_idx = 0;                // int64 [N, K] or 0
    uint64_t topk_weights = 0;            // fp32 [N, K] or 0
    uint64_t is_token_in_rank = 0;        // bool [N, R]
    uint64_t rank_prefix_matrix = 0, channel_prefix_matrix = 0, recv_channel_prefix_matrix = 0;
    int num_tokens = 0, hidden = 0, num_topk = 0, num_local_experts = 0;
    int fp8 = 0;
    int num_channels = 0, ring_tokens = 0, chunk_tokens = 0;
    int num_out_rows = 0;                 // rows of the outputs
    int num_worst_tokens = 0;             // > 0: pad rows past the real count (topk -1, weights 0, src -1)
    int use_tma = 3;                      // which row copies go by bulk copy (normal_tma.cuh kTmaLocal | kTmaPeer)
    uint64_t recv_x = 0, recv_x_scales = 0, recv_topk_idx = 0, recv_topk_weights = 0, recv_src_idx = 0;
    // Across nodes the tokens are a forwarder's rows (normal_internode.md): src_idx (int32 [N] or 0) is
    // the index each row reports as its source token (0: the row's own index), row_map (int32 [rows] or
    // 0) the final output row of each row in this kernel's (source, token) order (0: identity).
    uint64_t src_idx = 0, row_map = 0;
    // Bytes from one token's payload to the next (0: dense rows of the payload size). A forwarder reads
    // the payloads in place from its relayed rows (normal_internode.h RelayRow) instead of a copy.
    uint64_t x_row_bytes = 0;
    uint64_t send_head = 0;               // int32 [N, R] or 0: with a mask, entries of rows not sent are cleared
    uint64_t dropped = 0;                 // device int32 [R] or 0: tokens this call did not deliver to rank r
    // One-copy dispatch (normal_direct.cuh). direct: this call runs the descriptor handshake (every rank
    // of the call alike: the gate's signature holds it). direct_offer: recv_x, recv_x_scales and
    // direct_stage (staging rows of num_out_rows x stage_row_bytes, or 0 with a handle) lie in the pool.
    int direct = 0, direct_offer = 0;
    uint64_t direct_stage = 0;
};

struct CombineArgs {
    uint64_t x = 0;                       // bf16 [rows, H]
    uint64_t topk_weights = 0;            // fp32 [rows, K] or 0
    uint64_t bias0 = 0, bias1 = 0;        // bf16 [N, H] or 0
    uint64_t send_head = 0;               // int32 [N, R]
    uint64_t rank_prefix_matrix = 0, channel_prefix_matrix = 0, recv_channel_prefix_matrix = 0;
    int num_tokens = 0, hidden = 0, num_topk = 0;
    int num_channels = 0, ring_tokens = 0, chunk_tokens = 0;
    uint64_t out = 0;                     // bf16 [N, H]
    uint64_t out_weights = 0;             // fp32 [N, K] or 0
    uint64_t row_map = 0;                 // int32 [rows] or 0: where row i of the dispatch order sits in x
    uint64_t dropped = 0;                 // device int32 [R] or 0: tokens this call did not deliver to rank r
    int use_tma = 3;                      // normal_tma.cuh kTmaPeer: rows into peers' rings by bulk copy;
                                          // kTmaLocal: the reduce's rows loaded by bulk copy
    int pull = 0;                         // 1: this rank offered x for pulling in the call's gate (normal_pull.cuh);
                                          // 0: it did not, and so the call pushes on every rank
};

// Bytes of one ring slot for a call (payload, FP8 scales, top-k ids and weights, source index).
uint64_t dispatch_row_bytes(int hidden, int fp8, int num_topk);
uint64_t combine_row_bytes(int hidden, int num_topk);

// Host checks (std::invalid_argument): a buffer's statics; a launch's channels, rows against the slots
// and rings against the buffer (`what` names the call in the message).
void check_static(const NormalStatic& s);
void check_rings(const NormalStatic& s, const char* what, int num_channels, int ring_tokens, uint64_t row_bytes,
                 int hidden);

// Throw std::invalid_argument / std::runtime_error on bad arguments or launch errors.
void launch_layout(const NormalStatic& s, const LayoutArgs& a, uint64_t stream);
void launch_notify(const NormalStatic& s, const NotifyArgs& a, uint64_t stream);
void launch_dispatch(const NormalStatic& s, const DispatchArgs& a, uint64_t stream);
void launch_combine(const NormalStatic& s, const CombineArgs& a, uint64_t stream);

}  // namespace normal
}  // namespace pyep
