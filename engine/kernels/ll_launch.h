// Host entry points of the low-latency EP kernels (dispatch / combine) and the small CUDA runtime
// helpers the Python side needs for the NVLink transport (device buffers, IPC handles, peer access).
// Plain C++ types only (pointers and streams travel as uint64), so the pybind11 layer needs no CUDA
// headers. The buffer layout these offsets describe is defined in pyep/ep/ll/layout.py.
#pragma once

#include <stdint.h>

#include <string>

namespace pyep {
namespace ll {

// Everything that stays fixed for the lifetime of one EP buffer.
struct LLStatic {
    int rank = 0;
    int num_ranks = 0;            // R
    int num_local_experts = 0;    // E_l
    int num_max_tokens = 0;       // T
    int hidden = 0;               // H
    int max_topk = 0;             // K_max
    uint64_t buf = 0;             // this rank's buffer (device pointer)
    uint64_t peer_base = 0;       // device uint64[R]: where this rank may store into peer r's buffer
                                  // (own buffer for self, IPC mapping for NVLink), 0 = NIC path
    uint64_t remote_addr = 0;     // device uint64[R]: peer r's buffer address as its MR sees it
    uint64_t rkeys = 0;           // device uint32[R]
    uint32_t lkey = 0;            // this rank's buffer MR
    uint64_t qps = 0;             // device gda::Qp[R * num_qps_per_peer] (entries of NIC peers only)
    int num_qps_per_peer = 1;
    uint64_t flag_expect = 0;     // device int32[R]: combine flag value source r ends with
    uint64_t fetch_addr = 0;      // registered scratch for the fetched value of NIC atomics
    uint64_t workspace = 0;       // device int32[ws_words(R)], zeroed at creation, self-resetting
    // Layout (pyep/ep/ll/layout.py)
    uint64_t half_bytes = 0;
    uint64_t off_dsig = 0;
    uint64_t off_csig = 0;
    uint64_t off_cack = 0;        // per half: int32 [R] combine acknowledgements (ll_ack.cuh)
    uint64_t off_drecv = 0;
    uint64_t off_crecv = 0;
    uint64_t msg_bytes = 0;
    uint64_t slots_per_src = 0;
    int num_blocks = 0;           // grid size (<= number of SMs: every block must be resident)
    uint64_t trace = 0;           // 0, or device uint64[2][num_blocks][kTraceSlots]: per-block timeline
    uint64_t err = 0;             // 0 (check_values=False), or the error record: pinned, host-mapped
                                  // int32[kErrWords] (LLErrorWord), read by the host without a sync
    uint64_t call_err = 0;        // the call record (LLCallWord): pinned, host-mapped int32[kCallErrWords];
                                  // 0 only in tests that do not read it
    uint64_t peer_gen = 0;        // 0 (every rank is generation 0: a buffer on a process group), or device
                                  // int32[R]: each rank's membership generation, self included (its low
                                  // 4 bits travel in every signal word: docs/ll_kernels.md, "Call tags")
};

// The dispatch kernel's error record (pyep/ep/ll/errors.py decodes it). The first top-k entry of a
// dispatch that is outside [-1, E) or repeats an earlier slot's expert in its row (row-major order)
// is written by block 0, thread 0 -- only while `code` is 0, so the first error stays until the host
// has reported it -- with `code` stored last after a system-scope fence. The host clears `code`.
enum LLErrorWord : int { kErrCode = 0, kErrRow = 1, kErrK = 2, kErrValueLo = 3, kErrValueHi = 4, kErrFirstK = 5 };
enum LLErrorCode : int { kErrNone = 0, kErrExpertRange = 1, kErrExpertDuplicate = 2 };
constexpr int kErrWords = 8;

// The call record: an exchange of this rank's call went wrong with a peer (docs/ll_kernels.md, "Call
// tags"). Written by thread 0 of the last block of a receive phase, only while `code` is 0 (the first
// stays until the host took it), fields first, a system fence, then `code`. kCallSeq is this rank's
// call number (the dispatch sequence number, also for a combine of that dispatch), kCallWord the
// peer's signal word as it arrived, kCallExpect the tag this rank expected from that peer.
enum LLCallWord : int { kCallCode = 0, kCallKind = 1, kCallSeq = 2, kCallPeer = 3, kCallWord = 4, kCallExpect = 5 };
enum LLCallCode : int {
    kCallNone = 0,
    kCallPeerAborted = 1,   // the peer refused its call on the host and sent an abort marker instead
    kCallMismatch = 2,      // the peer's signal carries another call's tag (call number or generation)
    kCallSkipped = 3,       // a combine of a dispatch whose exchange failed: skipped on every rank
};
enum LLCallKind : int { kKindDispatch = 1, kKindCombine = 2 };
constexpr int kCallErrWords = 8;
// The largest T: a dispatch count word carries count + 1 in its 15-bit value field (ll_common.cuh).
constexpr int kMaxTokensPerRank = 0x7ffe;

// Timeline points (ll_common.cuh stamps them when LLStatic::trace is set; pyep/ep/ll/trace.py reads them).
enum TracePoint : int {
    kTrSendBegin = 0, kTrSendRouted = 1, kTrSendIssued = 2, kTrSendFenced = 3, kTrSendDone = 4,
    kTrRecvBegin = 5, kTrRecvReady = 6, kTrRecvCopied = 7, kTrRecvDone = 8,
    kTrSendSignaled = 9,   // last block only: the store (NVLink / local) signals are written
    kTrRecvPlanned = 10,   // dispatch: the row prefix over (expert, source) is known
    kTrRecvReduced = 11,   // combine: warp 0 stored its reduce items (no barrier: other warps may not have)
};
constexpr int kTraceSlots = 16;
enum TraceKernel : int { kTraceDispatch = 0, kTraceCombine = 1 };

enum Phase : int { kPhaseSend = 1, kPhaseRecv = 2 };

// WaitStats (DeepEP's dispatch/combine_wait_recv_cost_stats): when a call's wait_stats is set, its
// receive phase adds, per source rank r, the nanoseconds (%globaltimer) it spent waiting for r's
// signal(s): from the first poll that found them missing until they were all seen, or until r timed
// out. 0 when they were there at the first poll, and nothing for a source that is inactive. Added
// once per source and call, by the block whose verdict decided r (ll_arrival.cuh), as a 64-bit atomic
// add: the tensor accumulates over calls. DeepEP counts clock64 cycles and sums its per-expert waits;
// pyep's unit is the nanosecond on every GPU (docs/ll_kernels.md).

struct LLDispatchCall {
    uint64_t x = 0;               // bf16 [N, H]
    uint64_t topk = 0;            // int64 [N, K]
    int num_tokens = 0;           // N
    int num_topk = 0;             // K
    int half = 0;
    int use_fp8 = 0;
    int round_scale = 0;
    int use_ue8m0 = 0;
    uint64_t active = 0;          // int32 [R] (never 0: the backend passes its own mask when the caller has none)
    uint64_t recv_x = 0;          // bf16 or e4m3 [E_l, R*T, H]
    uint64_t recv_scales = 0;     // fp32 [E_l, G, R*T] or int32 [E_l, ceil(G/4), R*T]
    uint64_t src_info = 0;        // int32 [E_l, R*T]
    uint64_t recv_slot = 0;       // int32 [E_l, R*T]: top-k slot of each received row
    uint64_t layout_range = 0;    // int64 [E_l, R]
    uint64_t recv_count = 0;      // int32 [E_l]
    uint64_t cum_stats = 0;       // int32 [E_l] or 0
    uint64_t timeout_ns = 0;
    int phases = kPhaseSend | kPhaseRecv;
    uint64_t wait_stats = 0;      // int64 [R] or 0: receive wait per source, added in ns (WaitStats)
    uint32_t seq = 0;             // this call's number (EpBuffer's dispatch sequence, low 32 bits): its tag
    int abort = 0;                // 0, or the reason (1..0x7fff) this rank refused the call on the host: send
                                  // abort-tagged count words and no payload, receive the peers' words and
                                  // clear them, write no output (num_tokens 0, output pointers unused)
};

struct LLCombineCall {
    uint64_t x = 0;               // bf16 [E_l, R*T, H]
    uint64_t topk = 0;            // int64 [N, K]
    uint64_t weights = 0;         // fp32 [N, K]
    int num_tokens = 0;
    int num_topk = 0;
    int half = 0;
    uint64_t src_info = 0;        // from the dispatch
    uint64_t recv_slot = 0;
    uint64_t layout_range = 0;
    uint64_t active = 0;
    uint64_t out = 0;             // bf16 [N, H]
    uint64_t timeout_ns = 0;
    int phases = kPhaseSend | kPhaseRecv;
    int use_logfmt = 0;           // LogFMT-10 payload (pyep/ep/ll/logfmt.py); H % 512 == 0
    uint64_t wait_stats = 0;      // int64 [R] or 0: receive wait per source, added in ns (WaitStats)
    int repeat = 0;               // the handle was combined before: wait for every destination's
                                  // acknowledgement of our earlier combines on this half (ll_ack.cuh)
    uint32_t seq = 0;             // the number of the dispatch this combine belongs to (its tag)
    int abort = 0;                // 0, or the refusal reason: abort-tagged flags, no rows, no reduce
};

// The argument checks of one launch (ll_runtime.cu): std::invalid_argument naming what is wrong.
void check_static(const LLStatic& s);
void check_call(const LLStatic& s, const LLDispatchCall& c);
void check_call(const LLStatic& s, const LLCombineCall& c);
// Throw std::invalid_argument / std::runtime_error with a message on bad arguments or launch errors.
void launch_dispatch(const LLStatic& s, const LLDispatchCall& c, uint64_t stream);
void launch_combine(const LLStatic& s, const LLCombineCall& c, uint64_t stream);
// Dynamic shared memory bytes a launch needs (the host checks it against the device limit).
int dispatch_smem_bytes(const LLStatic& s);
int combine_smem_bytes(const LLStatic& s);
// Load the kernels' modules now and set their dynamic shared-memory limit for this shape (only
// num_ranks and num_local_experts are read). Under lazy module loading (CUDA's default) a kernel's
// first launch loads its module, and a load waits for the device to drain while holding the context
// lock: a combine launched behind a dispatch that spins on a peer's data then blocks the host, and
// with it this process's softnic thread, which that peer's data waits for -- both time out.
// cudaFuncGetAttributes forces the load (CUDA Programming Guide, "Lazy Loading").
void load_dispatch_kernels(const LLStatic& s);
void load_combine_kernels(const LLStatic& s);
#if defined(PYEP_LL_THREADS)
constexpr int kThreadsPerBlock = PYEP_LL_THREADS;   // CPU simulation: fewer threads per block
#else
constexpr int kThreadsPerBlock = 512;
#endif

// CUDA runtime helpers for the transports.
uint64_t device_alloc(uint64_t bytes);
void device_free(uint64_t ptr);
// Zeroed pinned host memory mapped into the device's address space at the same address (UVA): the
// error record. Throws if the device pointer differs from the host pointer.
uint64_t host_alloc_mapped(uint64_t bytes);
void host_free(uint64_t ptr);
void memset_async(uint64_t ptr, int value, uint64_t bytes, uint64_t stream);
void memcpy_htod(uint64_t dst, const void* src, uint64_t bytes);
// Raw CUDA events for stream ordering without torch's Stream objects (the normal mode's output pool):
// created with timing off, recorded on / waited by streams given as handles.
uint64_t event_create();
void event_destroy(uint64_t event);
void event_record(uint64_t event, uint64_t stream);
void stream_wait_event(uint64_t stream, uint64_t event);
std::string ipc_get_handle(uint64_t ptr);     // 64 bytes
uint64_t ipc_open_handle(const std::string& handle);
void ipc_close_handle(uint64_t ptr);
std::string device_pci_bus_id(int device);
bool can_access_peer(int device, int peer_device);
int current_device();
int num_sms(int device);
int max_smem_optin(int device);

}  // namespace ll
}  // namespace pyep
