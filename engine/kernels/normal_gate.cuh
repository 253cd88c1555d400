// The call gate of the intranode normal mode: the first exchange of every native call, inside the
// notify kernel (docs/normal_mode.md "Call-tagged exchanges", normal_tags.h for the words). Each rank
// writes its tag (generation, call number, kind, shape signature, status, reason) into every peer's
// notify slot of the call's parity, publishes the call number as the slot's flag, and waits for every
// peer's flags. A peer at another call is found from its flags (gate_classify) and told so with a
// NOTICE in its own slot; a peer's tag that disagrees, or says the peer refused the call, makes the
// call void on this rank: kWsVoid is set, the dispatch / combine kernels of the call do nothing, and
// the tag record tells the host why. Every rank reads the same tags, so all of them void the call.
#pragma once

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {

// Per peer, besides GateState: the wait ran out without a mask (the call is void), the peer was marked
// (its wait ran out with a mask, or an answering peer's tag left it out), the peer was out before the call.
constexpr int kGateTimedOut = -1, kGateMarked = -2, kGateSkipped = -3;

struct GateShared {
    uint32_t seq, epoch;
    int status, origin;                 // this rank's tag (after a void passed on from upstream)
    int hsig[2];                        // the handle's dispatch (call, generation), or 0
    int state[kMaxRanks];               // per peer: GateState or one of the kGate* above
    uint32_t peer_call[kMaxRanks];
    int is_void;
    uint32_t mine;                      // the buffer's mask at the call (mask_bits)
    unsigned int cmask;                 // the call's mask: mine AND every answering peer's, less the marked
    int tag[kMaxRanks][kTagOffSig + kTagSigInts];   // gate_read_tags: what gate_decide compares, per peer
};

// Thread 0: this call's number (advanced on the device: a graph replay is a new call), the generation,
// and the status: a void of a gate earlier in this call (the relay's, across nodes) is passed on.
__device__ __forceinline__ void gate_begin(const NormalStatic& s, const NotifyArgs& a, GateShared& g) {
    int* ws = reinterpret_cast<int*>(s.workspace);
    g.seq = next_call((uint32_t)ws[kWsSeq]);
    ws[kWsSeq] = (int)g.seq;
    g.epoch = (uint32_t)ws[kWsEpoch];
    g.status = a.status;
    g.origin = s.global_base + s.rank;
    const int* up = reinterpret_cast<const int*>(a.upstream);
    if (g.status == kTagOk && up && up[kWsVoid]) {
        g.status = kTagProxy;
        g.origin = up[kWsOrigin];       // -1: the upstream gate found ranks at different calls
    }
    const int* h = reinterpret_cast<const int*>(a.handle_tag);
    g.hsig[0] = h ? h[0] : 0;
    g.hsig[1] = h ? h[1] : 0;
    g.is_void = 0;
    g.mine = mask_bits(s);
    g.cmask = g.mine;
    if (h && g.hsig[1] == kHandleVoid && g.status == kTagOk) {
        // The handle is of a void dispatch: this call is refused here, and the host is told why (every
        // rank's handle of that dispatch is void, so every rank refuses and none records a peer's).
        g.status = kTagRefused;
        record_error(s, kErrVoidHandle, g.hsig[0], 0, 0);
    }
}

// Word i of this rank's tag (tags.py encode).
__device__ __forceinline__ int gate_tag_word(const NotifyArgs& a, const GateShared& g, int i, uint32_t call, int status) {
    switch (i) {
        case 0: return kTagMagic;
        case 1: return (int)g.epoch;
        case 2: return (int)call;
        case 3: return a.kind;
        case 4: return status;
        case 5: return g.origin;
        case kTagOffReasonLen: return a.reason_len;
        case kTagOffMask: return (int)g.mine;
        default: break;
    }
    if (i < kTagOffSig + kTagSigHandle) return a.sig[i - kTagOffSig];
    if (i < kTagOffReasonLen) return g.hsig[i - kTagOffSig - kTagSigHandle];
    const int b = 4 * (i - kTagOffReason);
    const uint8_t* r = reinterpret_cast<const uint8_t*>(a.reason);
    return (int)((uint32_t)r[b] | (uint32_t)r[b + 1] << 8 | (uint32_t)r[b + 2] << 16 | (uint32_t)r[b + 3] << 24);
}

__device__ __forceinline__ int* gate_slot(const NormalStatic& s, uint8_t* base, int parity, int src) {
    return words(base, s.off_notify) + (parity * s.num_ranks + src) * (int)s.notify_ints + kNotifyTag;
}
__device__ __forceinline__ int* gate_flag(const NormalStatic& s, uint8_t* base, int parity, int src) {
    return words(base, s.off_flag) + parity * s.num_ranks + src;
}

// All threads: this rank's tag into every peer's slot (before the flags are published).
__device__ __forceinline__ void gate_write_tags(const NormalStatic& s, const NotifyArgs& a, const GateShared& g) {
    const int R = s.num_ranks, parity = (int)(g.seq & 1u);
    for (int i = threadIdx.x; i < R * kTagInts; i += blockDim.x) {
        const int d = i / kTagInts;
        if (d != s.rank && !in_mask(g.mine, d)) continue;   // nothing goes to a rank out of the call
        gate_slot(s, peer_buf(s, d), parity, s.rank)[i % kTagInts] = gate_tag_word(a, g, i % kTagInts, g.seq, g.status);
    }
}

// A peer leaves this call (with a mask): out of the call's mask and of the buffer's.
__device__ __forceinline__ void gate_drop_peer(const NormalStatic& s, GateShared& g, int d) {
    atomicAnd(&g.cmask, ~(1u << d));
    reinterpret_cast<volatile int*>(s.active)[d] = 0;
}

// Thread d < R: publish this call's flag in peer d and wait for d's. A peer found at a later call gets
// a NOTICE in its slot of its own call's parity, with its call number as the flag, so that its own wait
// ends and it reports the mismatch too (it could not tell from its flags: to a rank one call ahead, a
// peer one call behind looks like a slow peer). A peer found behind gets none: it has not posted its
// next call yet, so its parity is not known, and when it does it finds this rank's later flag itself.
// With a mask (docs/elastic.md, "Normal mode"): a rank out of the buffer's mask gets nothing and is not
// waited for; an answering peer's tag ANDs its mask bits into the call's, which also ends the wait for a
// peer it left out (no second timeout); a wait that runs out marks the peer and the call goes on.
__device__ __forceinline__ void gate_publish_and_wait(const NormalStatic& s, const NotifyArgs& a, GateShared& g, int d) {
    const int parity = (int)(g.seq & 1u), me = s.rank;
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    g.peer_call[d] = g.seq;
    if (d != me && !in_mask(g.mine, d)) {
        g.state[d] = kGateSkipped;
        return;
    }
    __threadfence_system();
    st_release_sys(gate_flag(s, peer_buf(s, d), parity, me), (int)g.seq);
    uint32_t pc = 0;
    const volatile unsigned int* cmask = &g.cmask;
    const int st = gate_wait(s, d, gate_flag(s, own, parity, d), gate_flag(s, own, parity ^ 1, d), g.seq, &pc,
                             [&] { return s.active && !((*cmask >> d) & 1u); });
    g.state[d] = st;
    g.peer_call[d] = pc;
    if (st == kGateArrived && s.active && d != me) {
        // The peer's tag (written before its flag) says whom it takes part with.
        atomicAnd(&g.cmask, (unsigned int)ld_volatile(gate_slot(s, own, parity, d) + kTagOffMask) | ~((1u << s.num_ranks) - 1u));
    } else if (st < 0 && s.active) {
        g.state[d] = kGateMarked;
        gate_drop_peer(s, g, d);
    } else if (st < 0) {
        record_error(s, kErrPeerTimeout, d, kPhaseNotify, -1);
    } else if (st == kGateOther && call_is_after(pc, g.seq)) {
        int* slot = gate_slot(s, peer_buf(s, d), (int)(pc & 1u), me);
        for (int i = 0; i < kTagInts; ++i) slot[i] = gate_tag_word(a, g, i, g.seq, kTagNotice);
        __threadfence_system();
        st_release_sys(gate_flag(s, peer_buf(s, d), (int)(pc & 1u), me), (int)pc);
    }
}

// All threads, after every wait ended and the block's acquire fence: warp d copies peer d's tag words that
// gate_decide compares (its own slot of the call's parity) into shared memory, a word a lane. Thread 0
// reading them itself made one dependent load a word (each comparison short-circuits the next), 14 L2
// round trips a peer: on one H100 about 1 us of a gate's 8.5 at 2 ranks, 10 of 24-31 at 8.
static_assert(kTagOffSig + kTagSigInts <= 32, "gate_read_tags: a word a lane");
__device__ __forceinline__ void gate_read_tags(const NormalStatic& s, GateShared& g) {
    const int d = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (d >= s.num_ranks || d == s.rank || lane >= kTagOffSig + kTagSigInts) return;
    g.tag[d][lane] = ld_volatile(gate_slot(s, reinterpret_cast<uint8_t*>(s.buf), (int)(g.seq & 1u), d) + lane);
}

// Thread 0, after gate_read_tags: the peers' tags (own slots), decide whether the call is void,
// tell the host why (the tag record) and the call's kernels (kWsVoid, kWsOrigin).
__device__ __forceinline__ void gate_decide(const NormalStatic& s, const NotifyArgs& a, GateShared& g) {
    const int R = s.num_ranks, me = s.rank, parity = (int)(g.seq & 1u);
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    int mismatch = -1, refused = -1, origin = g.origin;
    bool timed_out = false;
    for (int d = 0; d < R && mismatch < 0; ++d) {
        if (d == me || g.state[d] == kGateSkipped || g.state[d] == kGateMarked) continue;
        if (g.state[d] == kGateTimedOut) {
            timed_out = true;
            continue;
        }
        if (g.state[d] == kGateOther) {
            mismatch = d;
            break;
        }
        const int* t = g.tag[d];
        const int status = t[4];
        if (t[0] != kTagMagic || status == kTagNotice || (uint32_t)t[1] != g.epoch || (uint32_t)t[2] != g.seq ||
            (status == kTagProxy && t[5] < 0)) {
            mismatch = d;
            break;
        }
        if (status != kTagOk) {
            if (refused < 0) {
                refused = d;
                origin = t[5];
            }
            continue;
        }
        bool same = t[3] == a.kind;
        for (int i = 0; i < kTagSigInts; ++i)
            same = same && t[kTagOffSig + i] == gate_tag_word(a, g, kTagOffSig + i, g.seq, g.status);
        if (!same && g.status == kTagOk) mismatch = d;
    }
    if (mismatch >= 0) {
        const bool flags = g.state[mismatch] == kGateOther;
        record_void(s.tag_record, kRecMismatch, s.global_base + mismatch, g.seq, g.epoch, a.kind, g.peer_call[mismatch],
                    flags ? nullptr : gate_slot(s, own, parity, mismatch), kTagNotice, -1);
        origin = -1;
    } else if (refused >= 0 && g.status == kTagOk) {
        record_void(s.tag_record, kRecRefused, s.global_base + refused, g.seq, g.epoch, a.kind, g.seq,
                    gate_slot(s, own, parity, refused), 0, 0);
    }
    g.is_void = g.status != kTagOk || timed_out || mismatch >= 0 || refused >= 0;
    // The call's ranks: a rank that a peer left out is out of this rank's mask from now on too; a rank
    // that others left out itself takes part in nothing (every peer has stopped sending to it).
    uint32_t cm = g.cmask & ((1u << R) - 1u);
    if (!in_mask(cm, me)) cm = 0;
    for (int d = 0; d < R && s.active; ++d)
        if (in_mask(g.mine, d) && !in_mask(cm, d)) reinterpret_cast<volatile int*>(s.active)[d] = 0;
    g.cmask = cm;
    int* ws = reinterpret_cast<int*>(s.workspace);
    ws[kWsVoid] = g.is_void;
    ws[kWsOrigin] = g.status == kTagOk ? origin : g.origin;
    ws[kWsMask] = (int)cm;
}

}  // namespace normal
}  // namespace pyep
