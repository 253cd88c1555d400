// What the low-latency combine's BF16 and LogFMT halves (ll_combine.cu, ll_combine_logfmt.cuh) share:
// the block's shared-memory carve, the RDMA write of a staged row to a NIC peer, and the top-k routing
// of a reduce item. Only ll_combine.cu includes it: its contents keep that file's internal linkage.
#pragma once

#include "kernels/ll_arrival.cuh"
#include "kernels/ll_logfmt.cuh"

namespace pyep {
namespace ll {
namespace {

struct CombineSmem {
    int* flag;      // [4]
    int* active;    // [R] PeerMode of each rank in this call
    int* ok;        // [R]
    int* dec;       // [R] receive: the call's verdict about each source (resolve_signal)
    int* cnt;       // [E] rows per (local expert, source rank), e-major
    int* rowstart;  // [E + 1]
    int* srcoff;    // [E + 1] plan_rows()
    int* scan;      // [plan_scratch_ints(E)]
    float* lf_tbl;  // [128] LogFMT log2 mantissa table (kLfLog2Mant)
    uint8_t* stage; // [kWarps][kLfStageBytes] LogFMT: one round of a warp's encoded row
};

__device__ CombineSmem carve_combine(uint8_t* p, int R, int E) {
    CombineSmem m;
    int* q = reinterpret_cast<int*>(p);
    m.flag = q; q += 4;
    m.active = q; q += R;
    m.ok = q; q += R;
    m.dec = q; q += R;
    m.cnt = q; q += E;
    m.rowstart = q; q += E + 1;
    m.srcoff = q; q += E + 1;
    m.scan = q;
    q += plan_scratch_ints(E);
    uint8_t* b = reinterpret_cast<uint8_t*>(q);
    b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(b) + 15) & ~uintptr_t(15));
    m.lf_tbl = reinterpret_cast<float*>(b);
    m.stage = b + 128 * 4;
    return m;
}

// Workspace words after ws_astate (layout.py: ws_words): per half, T x K_max self-row words. A fused combine
// (send and receive in one launch) does not copy the rows of this rank's own tokens into its own receive
// slots: the send writes each such row's index in x here, at (token, slot), and the reduce reads the row
// from x, which stays unchanged until the launch ends. It saves a write and a read of those rows (half
// of them with 2 ranks); a split combine (return_recv_hook) copies them as before, since x may change
// between the halves. The self flag, stored after every block's send, publishes these words too.
__device__ __forceinline__ int* ws_selfrow(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 16 + 9 * s.num_ranks + half * s.num_max_tokens * s.max_topk;
}
// Whether this launch reads its own rows from x (see ws_selfrow): a fused BF16 combine that sends rows.
// sm.active is the send's copy, so it is only read when this launch ran the send.
__device__ __forceinline__ bool reads_own_rows(const LLStatic& s, const LLCombineCall& c, const int* peer_modes) {
    return (c.phases & kPhaseSend) && (c.phases & kPhaseRecv) && !c.use_logfmt && !c.abort &&
           peer_modes[s.rank] == kPeerStore;
}

// NIC peers: a warp's staged row (`bytes` at `stage`) goes to `doff` in rank r's buffer as one RDMA WRITE
// on the QP of local expert e. Every lane's staging stores are made visible system-wide first: the NIC
// reads them over PCIe.
__device__ __forceinline__ void post_row(const LLStatic& s, const LLCombineCall& c, int r, int e, const uint8_t* stage,
                                         uint64_t doff, uint32_t bytes) {
    __threadfence_system();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        const int st = gda::post_rdma_write(peer_qp(s, r, e % s.num_qps_per_peer), (uint64_t)stage, s.lkey,
                                            remote_addr(s, r) + doff, rkey_of(s, r), bytes, false, c.timeout_ns);
        if (st != gda::kOk) note_failure(s, r);
    }
    __syncwarp();
}

// A reduce item's routing: lanes 0..K-1 load the top-k entry and weight of the item's row. Loaded one
// item ahead (the first before the wait): an item's routing is then in registers when the item starts,
// and its row loads do not wait a round trip behind it.
__device__ __forceinline__ void load_item_routing(const LLCombineCall& c, int64_t it, int64_t items, int col_chunks,
                                                  int64_t& v, float& w) {
    const int K = c.num_topk, lane = threadIdx.x & 31;
    v = -1;
    w = 0.0f;
    if (it < items && lane < K) {
        const int t = (int)(it / col_chunks);
        v = __ldg(reinterpret_cast<const int64_t*>(c.topk) + t * K + lane);
        w = __ldg(reinterpret_cast<const float*>(c.weights) + t * K + lane);
    }
}
// With reads_own_rows: lanes 0..K-1 load the item's self-row words (ws_selfrow), -1 otherwise. Written by
// this launch's send: only after the self flag was acquired, and with a coherent load.
__device__ __forceinline__ int load_item_selfrow(const LLStatic& s, const LLCombineCall& c, bool own, int64_t it,
                                                 int64_t items, int col_chunks) {
    const int lane = threadIdx.x & 31;
    if (!own || it >= items || lane >= c.num_topk) return -1;
    const int t = (int)(it / col_chunks);
    return ld_volatile(ws_selfrow(s, c.half) + t * s.max_topk + lane);
}

// Lanes 0..K-1 hold row t's top-k slots (v, w from load_item_routing): returns the lane's expert and
// sets its weight. An id dispatch routed as -1 (out of range, or a repeat of an earlier slot's expert)
// is -1 here too -- nothing was sent for it, and dispatch reports it -- and so is an expert whose owner
// did not arrive.
__device__ __forceinline__ int slot_expert(const LLCombineCall& c, const CombineSmem& sm, int El, int E, int t,
                                           int64_t v, float w, float& my_w) {
    const int K = c.num_topk, lane = threadIdx.x & 31;
    const int64_t* topk = reinterpret_cast<const int64_t*>(c.topk);
    const int64_t my_v = lane < K ? v : -1;
    my_w = lane < K ? w : 0.0f;
    bool bad;
    const int my_e = checked_expert(topk, t * K + lane, my_v, K, E, 0xffffffffu, t * K, bad);
    return my_e >= 0 && !sm.ok[my_e / El] ? -1 : my_e;
}

}  // namespace
}  // namespace ll
}  // namespace pyep
