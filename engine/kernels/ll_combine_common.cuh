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
