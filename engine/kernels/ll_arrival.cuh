// The low-latency kernels' arrival protocol: the "last block" completion of a phase (arrive_last), the
// consistent per-source decision with a %globaltimer timeout (resolve_signal, resolve_flag, and the
// dispatch receive's wait_counts), and what the last block of a phase does with the verdicts (the call
// record, timeouts and NIC failures applied to active_ranks). docs/ll_kernels.md, "Memory model", is
// the reasoning in prose.
#pragma once

#include "kernels/ll_common.cuh"

namespace pyep {
namespace ll {

// Completion protocol: every block calls this once after its part; the last block of the grid to
// arrive gets true (in all its threads). The barrier orders every thread's stores (into peers' memory
// too) before thread 0's fence and arrival: a release pattern, cumulative over what the barrier
// ordered before it (PTX memory model: causality order runs through bar.sync, as NCCL's flag stores
// after a barrier rely on). The last block's thread 0 fences again after observing every arrival, and
// the barrier then orders the block's signal stores after that fence: the signals can be relaxed
// stores. One fence per block, not per thread: fences of one SM run one after another (a release store
// per signal, 288 count signals, took 7 us on H200), and a fence in every thread kept 8 us between a
// block's last store and its arrival at T=1 on two H100s over NVLink.
// Scope: a send phase (kPeerScope) publishes its blocks' stores to other GPUs, so its fences are
// system-wide. A receive phase only needs its blocks' reads of this rank's own signal words ordered
// before the last block clears them, all on this GPU: GPU scope. Nothing outside the GPU relies on
// that order -- peers write this half again only after results of a later kernel reach them, and what
// the last block then publishes (the call record, combine acknowledgements) has its own system fence,
// which causality order chains after this one (write_call_record, send_acks).
enum ArriveScope : int { kGpuScope = 0, kPeerScope = 1 };

template <ArriveScope kScope>
__device__ __forceinline__ bool arrive_last(int* counter, int* s_flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (kScope == kPeerScope) __threadfence_system(); else __threadfence();
        const int prev = atomicAdd(counter, 1);
        const bool last = prev == (int)gridDim.x - 1;
        if (last) {
            if (kScope == kPeerScope) __threadfence_system(); else __threadfence();
        }
        *s_flag = last ? 1 : 0;
    }
    __syncthreads();
    return *s_flag != 0;
}

// WaitStats (ll_launch.h): the block whose CAS decided source r adds what it waited for r (stats: the
// call's wait_stats, 0 = none). An inactive source was not waited for and gets nothing.
__device__ __forceinline__ void add_wait(uint64_t stats, int r, int outcome, uint64_t waited_ns) {
    if (stats != 0 && outcome != kInactive && outcome != kUndecided)
        atomicAdd(reinterpret_cast<unsigned long long*>(stats) + r, (unsigned long long)waited_ns);
}

// Decides source rank r's word `flag` in this call identically for every block: the first block to
// find it complete (judge(value) != kUndecided), or to time out, or to find r inactive records the
// outcome with a CAS; everyone else adopts it. The timeout runs on %globaltimer (nanoseconds), never
// clock64, from the first poll that missed; the decider adds that wait to `stats` (add_wait). The first
// poll goes out with the decision word and the active flag, in one round trip (none of the three waits
// for another's value; loaded one after another they were three). `seen` (optional): whether this
// thread's own acquire load found the word complete -- if not, a caller that goes on to read what the
// word publishes must acquire it itself (another block decided). (The dispatch receive, with E_l words
// per source, uses wait_counts below.)
template <typename Judge>
__device__ __forceinline__ int resolve_signal(int* state, const int* active, int r, const int* flag, Judge judge,
                                              uint64_t timeout_ns, uint64_t stats, bool* seen = nullptr) {
    int st = ld_volatile(state + r);
    const int on = ld_volatile(active + r);
    int outcome = judge((uint32_t)ld_acquire_sys(flag));
    if (seen) *seen = outcome == kArrived;
    if (st != kUndecided) return st;
    uint64_t start = 0, waited = 0;
    if (on == 0) {
        outcome = kInactive;
    } else {
        while (outcome == kUndecided) {
            if (start == 0) start = gda::now_ns();
            LL_SPIN_HINT();
            st = ld_volatile(state + r);
            if (st != kUndecided) return st;
            waited = gda::now_ns() - start;
            if (waited > timeout_ns) {
                outcome = kTimedOut;
                break;
            }
            outcome = judge((uint32_t)ld_acquire_sys(flag));
        }
        if (seen) *seen = outcome == kArrived;
        if (start != 0 && outcome != kTimedOut) waited = gda::now_ns() - start;
    }
    const int prev = atomicCAS(state + r, kUndecided, outcome);
    if (prev != kUndecided) return prev;
    add_wait(stats, r, outcome, waited);
    return outcome;
}

// A counter that must reach `expect` (modulo 2^32: a counter may wrap, ll_ack.cuh): kArrived or not yet.
__device__ __forceinline__ int resolve_flag(int* state, const int* active, int r, const int* flag, int expect,
                                            uint64_t timeout_ns, uint64_t stats, bool* seen = nullptr) {
    return resolve_signal(state, active, r, flag, [expect](uint32_t v) {
        return (int)(v - (uint32_t)expect) >= 0 ? (int)kArrived : (int)kUndecided;
    }, timeout_ns, stats, seen);
}

// The dispatch receive's version of resolve_flag: each source sends E_l count words. Every thread
// polls its own (local expert, source) word -- together with that source's active flag and decision
// word, all in one round trip -- so all E words are awaited at once (walking them one after another
// per source was a chain of E_l dependent loads, tens of microseconds at E_l = 72). Then one thread per
// source records the block's verdict with the CAS protocol, so all blocks agree. Shared memory:
// src_state [R] (on return: the decision about source r), flags [R] (scratch), cnt [E] (on return:
// rows source r sent to local expert le at p = le * R + r, the signal's own index; 0 unless r arrived).
// Memory order: every poll is an acquire load, so each word this block uses was acquired by the thread
// that read it, and the barriers after the polls carry that to the threads that copy (causality runs
// through bar.sync). Relaxed polls with one system fence per block after them cost a fence on every
// receive (and a second one when the block adopted another block's verdict for words it had not seen);
// an acquire load is an ordinary load plus an L1 invalidation. A source decided before this block
// looked is adopted from the poll's own load of the decision word, and an undecided one goes straight
// to the CAS, which returns the verdict if another block was first: no round trip only to read it.
// With `stats` (WaitStats), waited [R] (shared) collects, per source, the latest moment a word this
// block had to wait for was seen, counted from this thread's entry; the deciding block adds it
// (add_wait). A word that is not call `seq`'s tag from its source (generation from `gens`,
// LLStatic::peer_gen, or 0), or is its abort marker, decides the source as kMismatch / kAborted (every
// one of its words counts 0); the generation is loaded in the same round trip as the first poll.
// Another call's tag stops this block's wait for that source's other words (they belong to the peer's
// own call and may never come; clean() clears them). An abort marker does not: the refusing rank writes
// it into every word, on the QP of each word's expert, in one launch, and a word on another QP can land
// after the first -- were the wait cut short, the last block would clear the half before it landed, and
// the stale marker would turn the next call on this half into a mismatch.
enum CountFlag : int { kSeenAll = 0, kUnseen = 1, kLate = 2, kInactiveSrc = 4, kAbortSeen = 8, kTagBad = 16 };

__device__ __forceinline__ void wait_counts(int* state, const int* active, const int* sig, int num_ranks,
                                            int num_pairs, int max_rows, uint64_t timeout_ns, int* src_state,
                                            int* flags, int* cnt, uint64_t stats, unsigned long long* waited,
                                            uint32_t seq, const int* gens) {
    const int R = num_ranks;
    const uint64_t entry = stats ? gda::now_ns() : 0;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        flags[r] = 0;
        src_state[r] = kUndecided;
        if (stats) waited[r] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int r = p % R;
        const int gen = gens ? __ldg(gens + r) : 0;     // the host changes it between calls only
        const int on = ld_volatile(active + r);
        const int st = ld_volatile(state + r);
        int v = ld_acquire_sys(sig + p);
        // A decision is final within the call: every thread that saw one saw the same.
        if (st != kUndecided) src_state[r] = st;
        if (on == 0) {
            atomicOr(flags + r, kInactiveSrc);
            v = 0;
        } else if (v == 0 && st == kUndecided) {
            uint64_t deadline = 0;
            for (int spins = 0;; ++spins) {
                LL_SPIN_HINT();
                if ((v = ld_acquire_sys(sig + p)) != 0) break;
                if ((spins & 15) != 15) continue;
                // Someone (another block, or a thread of this one) already settled r: stop waiting. A
                // decision is only taken once a block saw all of r's words (or timed out), so stopping then
                // leaves none of them in flight.
                if (ld_volatile(state + r) != kUndecided || (*(volatile int*)(flags + r) & (kLate | kTagBad)))
                    break;
                const uint64_t now = gda::now_ns();
                if (deadline == 0) {
                    deadline = now + timeout_ns;
                } else if (now > deadline) {
                    atomicOr(flags + r, kLate);
                    break;
                }
            }
            if (stats) atomicMax(waited + r, (unsigned long long)(gda::now_ns() - entry));
        }
        cnt[p] = v;
        if (v == 0) {
            atomicOr(flags + r, kUnseen);
        } else if (on != 0) {
            const int j = judge_signal((uint32_t)v, call_tag(seq, gen), 1);
            if (j != kArrived) atomicOr(flags + r, j == kAborted ? kAbortSeen : kTagBad);
        }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        if (src_state[r] != kUndecided) continue;
        // A source is late for this block only if one of its words stayed unseen while nobody had
        // decided (a decided state is never undecided again within the call).
        const int f = flags[r];
        const int outcome = (f & kInactiveSrc) ? kInactive : (f & kAbortSeen) ? kAborted
                            : (f & kTagBad) ? kMismatch : (f & kUnseen) ? kTimedOut : kArrived;
        const int prev = atomicCAS(state + r, kUndecided, outcome);
        src_state[r] = prev == kUndecided ? outcome : prev;
        if (prev == kUndecided) add_wait(stats, r, outcome, stats ? waited[r] : 0);
    }
    __syncthreads();
    // Another block saw every word of r and decided "arrived" first: read the words it saw (they are
    // visible to us too by now, or very soon), each with acquire like the polls.
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        if (src_state[p % R] != kArrived || cnt[p] != 0) continue;
        const uint64_t deadline = gda::now_ns() + timeout_ns;
        int v;
        while ((v = ld_acquire_sys(sig + p)) == 0 && gda::now_ns() < deadline) LL_SPIN_HINT();
        cnt[p] = v;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        const int n = src_state[p % R] == kArrived ? max(0, min((int)((uint32_t)cnt[p] & kSigValue) - 1, max_rows)) : 0;
        cnt[p] = n;
    }
    __syncthreads();
}

// The call record (ll_launch.h), by one thread, unless an earlier entry is still unreported: fields
// first, a system fence, then the code word the host reads.
__device__ __forceinline__ bool write_call_record(const LLStatic& s, int code, int kind, uint32_t seq, int peer,
                                                  uint32_t word, uint32_t expect) {
    int* rec = reinterpret_cast<int*>(s.call_err);
    if (rec == nullptr || ld_volatile(rec + kCallCode) != kCallNone) return false;
    rec[kCallKind] = kind;
    rec[kCallSeq] = (int)seq;
    rec[kCallPeer] = peer;
    rec[kCallWord] = (int)word;
    rec[kCallExpect] = (int)expect;
    __threadfence_system();
    st_relaxed_sys(rec + kCallCode, code);
    return true;
}

// Last block of a receive phase, every thread, before the decisions are cleared: whether any source's
// exchange failed in this call (one parallel pass over the decisions; `scratch`: a shared int), and if
// one did, thread 0 writes the first (by rank) into the call record. `decisions` [R]: this block's copy
// of the call's per-source verdicts in shared memory -- every block adopted the same ones (the CAS
// protocol), so the last block reads its own instead of the workspace words, a round trip less at the
// end of every receive. word(r): source r's offending signal word. A rank that refused the call itself
// (`refused`: its host already raised) records only mismatches. The caller syncs before it clears the
// words word(r) reads.
template <typename Word>
__device__ bool record_call(const LLStatic& s, const int* decisions, int* scratch, int kind, uint32_t seq, bool refused,
                            Word word) {
    if (threadIdx.x == 0) *scratch = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x)
        if (decisions[r] == kAborted || decisions[r] == kMismatch) atomicOr(scratch, 1);
    __syncthreads();
    const bool failed = *(volatile int*)scratch != 0;
    if (failed && threadIdx.x == 0) {     // the rare path: a serial walk is fine
        for (int r = 0; r < s.num_ranks; ++r) {
            const int st = decisions[r];
            if ((st == kAborted && !refused) || st == kMismatch) {
                write_call_record(s, st == kAborted ? kCallPeerAborted : kCallMismatch, kind, seq, r, word(r),
                                  call_tag(seq, gen_of(s, r)));
                break;
            }
        }
    }
    return failed;
}

// At the end of a receive phase (last block only): a source that timed out is marked inactive in the
// caller's active_ranks, and the decisions are cleared for the next call on this half. Marks are
// applied only here, after every block of the launch has read active_ranks, so that all blocks of a
// launch see one membership. decisions: the block's shared copy of the verdicts (record_call).
__device__ __forceinline__ void finish_decisions(int* state, const int* decisions, int* active, int num_ranks) {
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
        if (decisions[r] == kTimedOut) atomicExch(active + r, 0);
        state[r] = kUndecided;
    }
}

// Send failures on the NIC path (a post that returned an error) are collected in the workspace and
// applied by the last block of the send phase, for the same reason.
// Only NIC posts fail: with no NIC peer (peer_modes: this call's PeerMode per rank, shared memory)
// there is nothing to collect, and no reason to make threads that just stored signals wait on loads.
__device__ __forceinline__ void finish_failures(const LLStatic& s, const int* peer_modes, int* active) {
    if (!any_peer_of(peer_modes, s.num_ranks, kPeerNic)) return;
    int* fail = ws_fail(s);
    for (int r = threadIdx.x; r < s.num_ranks; r += blockDim.x) {
        if (ld_volatile(fail + r)) {
            atomicExch(active + r, 0);
            fail[r] = 0;
        }
    }
}

// ---- NIC posting -----------------------------------------------------------------------------------
__device__ __forceinline__ void note_failure(const LLStatic& s, int r) { atomicExch(ws_fail(s) + r, 1); }

}  // namespace ll
}  // namespace pyep
