// Combine acknowledgements: what lets a handle be combined again (docs/ll_kernels.md, "A handle
// combined again"; pyep/ep/ll/layout.py defines the words).
//
// A combine uses its dispatch's half: the token owner's receive rows and flags there, and on the NIC
// path the expert owner's dispatch receive slots as staging. Calls that alternate halves are ordered by
// the two-call rule; a second combine of the same handle is not. So every combine receive ends by adding
// 1 to cack[h][me] in each source's buffer (after the last block cleared the half's flags and
// decisions), every combine send counts what it sent in csent[h][r] (workspace, last block), and a
// combine the host flags `repeat` first waits, per destination r, until r's acknowledgements in our own
// cack[h][r] reach csent[h][r] as it was when the call began: r has then finished reducing every earlier
// combine of ours on half h, its flags are clear again, and our NIC rows of those combines were read
// (r saw their flag, which follows them on the same RC QP). Counters are compared modulo 2^32.
#pragma once

#include "kernels/ll_arrival.cuh"

namespace pyep {
namespace ll {

// Workspace words after ws_fail (layout.py: ws_words, ws_csent_index): per half, combines sent to each
// rank, then per half the shared verdict of a repeated combine's wait for each destination.
__device__ __forceinline__ int* ws_csent(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 16 + 5 * s.num_ranks + half * s.num_ranks;
}
__device__ __forceinline__ int* ws_astate(const LLStatic& s, int half) {
    return reinterpret_cast<int*>(s.workspace) + 16 + 7 * s.num_ranks + half * s.num_ranks;
}
// cack[half][src] in a rank's buffer: the combines of that rank on `half` that rank src has reduced.
__device__ __forceinline__ uint64_t off_cack(const LLStatic& s, int half, int src) {
    return half * s.half_bytes + s.off_cack + 4ull * src;
}

// A fire-and-forget add into a peer's memory (NVLink / own buffer): the result is not needed, so a
// reduction, not an atomic that waits for the old value. Relaxed: callers order it by a fence before.
#if !defined(PYEP_LL_CPU_SIM)
__device__ __forceinline__ void red_add_sys(int* p, int v) {
    asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#else
__device__ __forceinline__ void red_add_sys(int* p, int v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
#endif

// Repeated combine, every block, before its first row: for every destination this call sends to, wait
// (bounded by the call's timeout, %globaltimer) until the destination acknowledged every combine we sent
// it on this half. csent only changes in the last block of a send phase, after every block has passed
// here, so all blocks read the same value. The verdict is shared through the per-half decision word
// (resolve_flag's CAS protocol), so either every block sends to r or none does; a destination that
// timed out is dropped from this call (peer_modes: shared memory, this call's PeerMode per rank): it gets
// no row and no flag, and finish_acks marks it inactive.
__device__ __forceinline__ void wait_acks(const LLStatic& s, const LLCombineCall& c, int* peer_modes) {
    const int* sent = ws_csent(s, c.half);
    int* state = ws_astate(s, c.half);
    const int* active = reinterpret_cast<const int*>(c.active);
    const uint8_t* hb = reinterpret_cast<const uint8_t*>(s.buf);
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x) {
        if (peer_modes[r] == kPeerInactive) continue;
        const int* ack = reinterpret_cast<const int*>(hb + off_cack(s, c.half, r));
        bool seen = false;
        const int st = resolve_flag(state, active, r, ack, ld_volatile(sent + r), c.timeout_ns, 0, &seen);
        if (st == kArrived) {
            // Acquire in this thread too when another block decided: our stores to r's rows and to our
            // staging slots follow r's reduce loads that the acknowledgement publishes.
            if (!seen) (void)ld_acquire_sys(ack);
        } else {
            peer_modes[r] = kPeerInactive;
        }
    }
    __syncthreads();
}

// Last block of a send phase: count the combine for every destination it went to (peer_modes: after
// wait_acks), and with `repeat`, apply the waits' timeouts to active_ranks and clear the verdicts for the
// next repeated combine on this half (every block has read them: they all arrived before the last).
__device__ __forceinline__ void finish_acks(const LLStatic& s, const LLCombineCall& c, const int* peer_modes,
                                            int* active) {
    int* sent = ws_csent(s, c.half);
    int* state = ws_astate(s, c.half);
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x) {
        if (peer_modes[r] != kPeerInactive && !c.abort) sent[r] += 1;   // an abort sends no rows to acknowledge
        if (!c.repeat) continue;
        if (ld_volatile(state + r) == kTimedOut) atomicExch(active + r, 0);
        state[r] = kUndecided;
    }
}

// Last block of a receive phase, after it cleared this half's flags and decisions: add 1 to cack[h][me]
// on every source whose flag arrived in this call (ok: shared memory, the call's verdicts), one signal
// per source -- a reduction for store peers, a masked fetch-add on the NIC (like the flags). The
// barrier / system fence / barrier orders every block's reduce loads (they arrived before this block
// was last) and this block's clearing stores before the acknowledgements, as arrive_last orders the
// signals after the data.
__device__ __forceinline__ void send_acks(const LLStatic& s, const LLCombineCall& c, const int* ok) {
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint64_t off = off_cack(s, c.half, s.rank);
    for (int r = warp; r < s.num_ranks; r += kWarps) {
        if (lane != 0 || !ok[r]) continue;
        if (peer_base(s, r) != 0) {
            red_add_sys(reinterpret_cast<int*>(peer_base(s, r) + off), 1);
            continue;
        }
        const int st = gda::post_masked_fa32(peer_qp(s, r, 0), remote_addr(s, r) + off, rkey_of(s, r), 1u,
                                             s.fetch_addr, s.lkey, false, c.timeout_ns);
        if (st != gda::kOk) note_failure(s, r);   // applied by the next send phase's last block
    }
}

}  // namespace ll
}  // namespace pyep
