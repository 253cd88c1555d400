// The RDMA stage of the normal mode across nodes (docs/normal_internode.md): rows travel between the
// ranks of one column (same local index on every node) through bounded rings in the receiver's relay
// buffer, posted by GPU threads on our mlx5 QPs (qp.h: WQE encoding, doorbells, send-queue room by CQ
// polling, error CQEs). Per (sender, receiver) pair and direction there is one ring of Q slots and two
// absolute counters that only grow (modulo 2^32):
//   tail[src] in the receiver's buffer: rows the sender published; the sender's masked fetch-add,
//       posted on the same QP right behind the RDMA write(s) of the rows (RC executes a QP's WQEs in
//       order, and the responder places the write's data before it executes the atomic);
//   head[dst] in the sender's buffer: rows the receiver consumed; the receiver's fetch-add after it
//       copied them out, which is also the proof that the NIC finished reading the sender's staging
//       slots (a slot is reused only once head passed it).
// Every call starts on an empty ring (the sender waits for head == tx first), so row size and Q may
// change between calls. Every wait is bounded; an expired wait records PeerTimeout(peer, phase) and a
// failed post records the QP's error (error CQE syndrome, QP number) naming the peer.
#if !defined(PYEP_LL_CPU_SIM)   // tests/ll_sim/relay_sim.cpp compiles the kernels as host C++
#include <cuda_runtime.h>
#endif

#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"
#include "kernels/normal_internode.h"
#include "mlx5gda/qp.h"

namespace pyep {
namespace normal {
namespace {

// How long a wait on a column peer (another node) lasts before the peer counts as silent: two timeouts.
// The peer's relay starts after its own node's kernels of the call, and those may wait out a timeout
// for a dead rank of that node first (normal_common.cuh PeerClock: a waiting rank is alive, but no
// heartbeat crosses the NIC). One timeout here would take that live node for dead.
__device__ __forceinline__ uint64_t column_timeout_ns(const RelayStatic& s) { return kAliveCap * s.timeout_ns; }

__device__ __forceinline__ uint8_t* rbuf(const RelayStatic& s) { return reinterpret_cast<uint8_t*>(s.buf); }
__device__ __forceinline__ int* rword(const RelayStatic& s, uint32_t off, int i) {
    return reinterpret_cast<int*>(s.buf) + off + i;
}
__device__ __forceinline__ int column_peer(const RelayStatic& s, int m) { return m * s.ranks_per_node + s.local; }
__device__ __forceinline__ gda::Qp* relay_qp(const RelayStatic& s, int m, int j) {
    return reinterpret_cast<gda::Qp*>(s.qps) + (m * s.num_qps_per_peer + j % s.num_qps_per_peer);
}
__device__ __forceinline__ uint64_t raddr(const RelayStatic& s, int m) {
    return reinterpret_cast<const uint64_t*>(s.remote_addr)[m];
}
__device__ __forceinline__ uint32_t rkey(const RelayStatic& s, int m) {
    return reinterpret_cast<const uint32_t*>(s.rkeys)[m];
}

// The error record is the intranode one (same words, same first-error-wins claim).
__device__ void relay_error(const RelayStatic& s, int code, int a, int b, int c) {
    record_error_words(s.err, s.workspace, code, a, b, c);
}

// ---- the mask (docs/elastic.md, "Normal mode"): the column's part of the buffer's -------------------
// Bit m: node m's column peer. A rank whose own entry is 0 exchanges with nobody (its own bit stays:
// its own node's run is local).
__device__ uint32_t column_mask(const RelayStatic& s) {
    const uint32_t all = s.num_nodes >= 32 ? 0xffffffffu : (1u << s.num_nodes) - 1u;
    if (!s.active) return all;
    const volatile int* act = reinterpret_cast<const volatile int*>(s.active);
    if (!act[column_peer(s, s.node)]) return 1u << s.node;
    uint32_t bits = 1u << s.node;
    for (int m = 0; m < s.num_nodes; ++m) bits |= (act[column_peer(s, m)] != 0 ? 1u : 0u) << m;
    return bits;
}
__device__ __forceinline__ uint32_t relay_call_mask(const RelayStatic& s) {
    return (uint32_t)ld_volatile(reinterpret_cast<const int*>(s.workspace) + kWsMask);
}
// A column peer silent past the timeout, or whose QP failed, with a mask: out of the buffer's mask
// (later calls leave it out) and of this call's (the call's other blocks stop waiting for it); nothing
// is recorded as an error. The intranode kernels' mark_peer_failed, for the column.
__device__ void mark_column_peer(const RelayStatic& s, int m) {
    reinterpret_cast<volatile int*>(s.active)[column_peer(s, m)] = 0;
    atomicAnd(reinterpret_cast<int*>(s.workspace) + kWsMask, ~(1 << m));
}

// A post that did not return kOk: the QP's own record says why (error CQE, ring or ordering timeout).
// With a mask the peer is marked instead: a dead peer shows as either (a timeout, or on a NIC the
// retry-exceeded error CQE of a responder that is gone).
__device__ void qp_failed(const RelayStatic& s, gda::Qp* qp, int m, int st, int phase) {
    if (s.active) {
        mark_column_peer(s, m);
        return;
    }
    if (st == gda::kErrQp || gda::qp_in_error(qp)) {
        const gda::QpError& e = qp->err;
        relay_error(s, kErrQp, column_peer(s, m), (int)e.syndrome | ((int)e.vendor_syndrome << 8) | ((int)e.kind << 16),
                    (int)qp->qpn);
    } else {
        relay_error(s, kErrPeerTimeout, column_peer(s, m), phase, -1);
    }
}

// ---- counts: one 8-byte record per (sender, receiver) and call, by call parity ----------------------
// A rank cannot post the record of call k+2 before every column peer posted k+1, which a peer does
// only after its call k read our record k: two slots per peer suffice (the intranode notify's argument).
// The call number is the device's (kWsSeq, advanced here), not a launch argument: a CUDA graph replays
// its captured arguments, and every replay must still be a new call. The exchange is also the column's
// call gate (normal_gate.cuh does the same inside a node): a record carries the generation and the
// call's status; a peer at another call is found from its records of both parities and told so (a
// NOTICE record in its slot of its own call's parity); a void call (a peer refused it, or passed on a
// refusal) moves no rows: kWsVoid makes relay_kernel idle on every rank of the column alike.
struct CountsShared {
    uint32_t seq, epoch;
    int status, origin;
    int got[kMaxNodes];
    int state[kMaxNodes];               // GateState, or -1: no answer (timeout, failed post, own node)
    uint32_t peer_call[kMaxNodes];
    uint64_t record[kMaxNodes];
    int fail, is_void;
    unsigned int cmask;                 // the call's column peers (column_mask, less those marked here)
};

// Thread m: one 8-byte RDMA write of `record` into count[par][this node] of node m's column peer, from
// outbox[par][m] (read by the NIC; quiet before the slot is reused), then quiet.
__device__ int post_record(const RelayStatic& s, int m, int par, uint64_t record) {
    const int M = s.num_nodes;
    uint64_t* out = reinterpret_cast<uint64_t*>(rbuf(s) + 4ull * s.off_outbox) + par * M + m;
    *out = record;
    __threadfence_system();   // the NIC reads the record over PCIe
    gda::Qp* qp = relay_qp(s, m, 0);
    const uint64_t dst = raddr(s, m) + 4ull * s.off_count + 8ull * (par * M + s.node);
    int st = gda::post_rdma_write(qp, reinterpret_cast<uint64_t>(out), s.lkey, dst, rkey(s, m), 8, false, s.timeout_ns);
    // quiet: the record was placed (or an error CQE names why not: a bad rkey, a peer that is gone)
    // before this rank waits for the peer's record, so a broken QP is reported at this call.
    if (st == gda::kOk) st = gda::quiet(qp, s.timeout_ns);
    if (st != gda::kOk) qp_failed(s, qp, m, st, kPhaseRdmaCounts);
    return st;
}

__global__ void __launch_bounds__(32) relay_counts_kernel(RelayStatic s, RelayCountsArgs a) {
    const int m = threadIdx.x;
    const int M = s.num_nodes;
    CountsShared& sh = block_shared<CountsShared>();
    int* ws = reinterpret_cast<int*>(s.workspace);
    if (m == 0) {
        // One block, one launch at a time on the buffer's stream order: a plain read-modify-write.
        sh.seq = next_call((uint32_t)ws[kWsSeq]);
        ws[kWsSeq] = (int)sh.seq;
        sh.epoch = (uint32_t)ws[kWsEpoch];
        sh.status = a.status;
        sh.origin = a.origin;
        const int* up = reinterpret_cast<const int*>(a.upstream);
        if (sh.status == kTagOk && up && up[kWsVoid]) {
            sh.status = kTagProxy;
            sh.origin = up[kWsOrigin];   // -1: the upstream gate found ranks at different calls
        }
        const int* h = reinterpret_cast<const int*>(a.handle_tag);
        if (sh.status == kTagOk && h && h[1] == kHandleVoid) sh.status = kTagRefused;   // the node gate records why
        sh.fail = 0;
        sh.cmask = column_mask(s);
        // The relay launches of this call (and a mark by post_record below) read and clear these bits.
        ws[kWsMask] = (int)sh.cmask;
    }
    __syncthreads();
    const bool in_call = m < M && m != s.node && ((sh.cmask >> m) & 1u);
    const uint32_t seq = sh.seq;
    const int par = (int)(seq & 1u);
    // A void record carries the refusing rank where a live one carries rows (all ones: a call mismatch).
    const uint32_t payload = (uint32_t)(sh.status == kTagOk ? reinterpret_cast<const int*>(a.send_counts)[m < M ? m : 0]
                                                            : (sh.origin < 0 ? (int)kRecordMaxRows : sh.origin));
    if (in_call && post_record(s, m, par, relay_count_record(seq, sh.epoch, a.kind, sh.status, payload)) != gda::kOk) {
        if (s.active) atomicAnd(&sh.cmask, ~(1u << m));   // marked (qp_failed): the call goes on without it
        else atomicExch(&sh.fail, 1);
    }
    if (m < M) {
        sh.got[m] = 0;
        sh.state[m] = -1;   // no answer read (this node, or a failed post: the call is void anyway)
    }
    __syncthreads();
    if (in_call && ((sh.cmask >> m) & 1u) && !sh.fail) {
        const volatile uint64_t* slots = reinterpret_cast<const uint64_t*>(rbuf(s) + 4ull * s.off_count);
        const uint64_t start = gda::now_ns();
        uint32_t pc = 0;
        int st;
        for (;;) {   // other parity first (normal_tags.h gate_classify)
            const uint32_t o = record_seq(slots[(par ^ 1) * M + m]);
            const uint64_t v = slots[par * M + m];
            st = gate_classify(record_seq(v), o, seq);
            if (st == kGateArrived) sh.record[m] = v;
            if (st != kGateWait) {
                pc = st != kGateArrived ? gate_peer_call(record_seq(v), o) : seq;
                if (st == kGateArrived && record_status(v) == kTagNotice) {
                    // A NOTICE in our slot carries our call number; the notifier's own is its record of the
                    // other parity, placed (quiet) before it posted the notice: read it again now.
                    __threadfence();
                    pc = record_seq(slots[(par ^ 1) * M + m]);
                }
                break;
            }
            if (gda::now_ns() - start > column_timeout_ns(s)) {
                if (s.active) {   // marked: no answer, no error, the call goes on without it
                    mark_column_peer(s, m);
                    atomicAnd(&sh.cmask, ~(1u << m));
                    st = -2;
                } else {
                    relay_error(s, kErrPeerTimeout, column_peer(s, m), kPhaseRdmaCounts, -1);
                    st = -1;
                }
                break;
            }
            LL_SPIN_HINT();
        }
        sh.state[m] = st;
        sh.peer_call[m] = pc;
        if (st == -1) atomicExch(&sh.fail, 1);
        // Only a peer that is ahead is told (normal_gate.cuh gate_publish_and_wait: a peer behind finds
        // this rank's later record itself, and its own parity is not known yet). The NIC read
        // outbox[pc & 1][m] of an earlier call before that call's quiet.
        if (st == kGateOther && call_is_after(pc, seq))
            post_record(s, m, (int)(pc & 1u), relay_count_record(pc, sh.epoch, a.kind, kTagNotice, 0));
    }
    __syncthreads();
    if (m == 0) {
        // The verdict, as the intranode gate's: a call mismatch first, else a refusal; recorded for the
        // host (the node's tag record) unless this rank's own call is void already (it knows why).
        int mismatch = -1, refused = -1, origin = sh.origin;
        for (int i = 0; i < M && mismatch < 0; ++i) {
            if (i == s.node || sh.state[i] < 0) continue;
            const uint64_t r = sh.record[i];
            const int st = record_status(r);
            // A peer at the same call number making another kind of call (one rank per node: no node gate
            // compares them) is at another call.
            if (sh.state[i] == kGateOther || st == kTagNotice || record_epoch(r) != (sh.epoch & kRecordEpochMask) ||
                record_kind(r) != a.kind || (st != kTagOk && record_rows(r) == kRecordMaxRows)) {
                mismatch = i;
            } else if (st != kTagOk && refused < 0) {
                refused = i;
                origin = (int)record_rows(r);
            } else if (st == kTagOk) {
                sh.got[i] = (int)record_rows(r);
            }
        }
        if (mismatch >= 0) {
            record_void(s.tag_record, kRecMismatch, column_peer(s, mismatch), seq, sh.epoch, a.kind,
                        sh.peer_call[mismatch], nullptr, kTagNotice, -1,
                        sh.state[mismatch] == kGateArrived ? record_kind(sh.record[mismatch]) : 0);
            origin = -1;
        } else if (refused >= 0 && sh.status == kTagOk) {
            record_void(s.tag_record, kRecRefused, column_peer(s, refused), seq, sh.epoch, a.kind, seq, nullptr,
                        record_status(sh.record[refused]), origin);
        }
        sh.is_void = sh.status != kTagOk || sh.fail || mismatch >= 0 || refused >= 0;
        ws[kWsVoid] = sh.is_void;
        atomicAnd(ws + kWsMask, (int)sh.cmask);   // a mark by post_record cleared its bit there already
        ws[kWsOrigin] = sh.status == kTagOk ? origin : sh.origin;
        int* rc = reinterpret_cast<int*>(a.recv_counts);
        volatile int* host = reinterpret_cast<volatile int*>(a.host_counts);
        int total = 0;
        for (int i = 0; i < M; ++i) {
            const int c = (sh.is_void || i == s.node || !((sh.cmask >> i) & 1u)) ? 0 : sh.got[i];
            rc[i] = c;
            total += c;
            if (host) {
                host[2 + i] = c;
                host[2 + M + i] = reinterpret_cast<const int*>(a.send_counts)[i];
            }
        }
        rc[M] = total;
        if (host) {
            host[1] = total;
            __threadfence_system();
            // The host waits for it; negative: read the error and tag records (a failed or void call).
            host[0] = sh.is_void ? -a.host_ticket : a.host_ticket;
        }
    }
}

// Thread 0 waits for node m's counter; the block learns the outcome through shared memory: kReached,
// kTimedOut (no mask: the caller records PeerTimeout) or kPeerOut (with a mask: another block of the
// call marked m, or this wait ran out and marked it).
enum WaitOutcome : int { kReached = 0, kTimedOut = 1, kPeerOut = 2 };
__device__ int block_wait(const RelayStatic& s, int m, const int* ctr, uint32_t target, int* flag) {
    if (threadIdx.x == 0) {
        int r = kReached;
        if (!s.active) {
            r = wait_counter(ctr, target, column_timeout_ns(s)) ? kReached : kTimedOut;
        } else if ((int)((uint32_t)ld_acquire_sys(ctr) - target) < 0) {
            const uint64_t start = gda::now_ns();
            while ((int)((uint32_t)ld_acquire_sys(ctr) - target) < 0) {
                if (!((relay_call_mask(s) >> m) & 1u)) {
                    r = kPeerOut;
                    break;
                }
                if (gda::now_ns() - start > column_timeout_ns(s)) {
                    mark_column_peer(s, m);
                    r = kPeerOut;
                    break;
                }
                LL_SPIN_HINT();
            }
        }
        *flag = r;
    }
    __syncthreads();
    return *flag;
}

// Copy `rows` rows of row_bytes between (possibly wrapping) ring slots and a dense array; one warp per row.
// Only the first `keep` rows are copied (a receiver past its output's capacity still consumes the rest).
__device__ void copy_rows(uint8_t* dst, const uint8_t* src, int rows, int row_bytes, bool dst_ring, bool src_ring,
                          uint32_t ring_first, int Q, int keep = 1 << 30) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = warp; j < min(rows, keep); j += kRelayWarps) {
        const uint64_t slot = (ring_first + (uint32_t)j) % (uint32_t)Q;
        uint8_t* d = dst + (dst_ring ? slot : (uint64_t)j) * row_bytes;
        const uint8_t* sp = src + (src_ring ? slot : (uint64_t)j) * row_bytes;
        warp_copy(d, sp, row_bytes, lane);
    }
}

struct SendShared {
    int flag;
};
__device__ void relay_send(const RelayStatic& s, const RelayArgs& a, int m) {
    int& flag = block_shared<SendShared>().flag;
    const int* off = reinterpret_cast<const int*>(a.send_offsets);
    const int n = off[m + 1] - off[m];
    const uint8_t* rows = reinterpret_cast<const uint8_t*>(a.src) + (uint64_t)off[m] * a.row_bytes;
    int* tx_word = rword(s, s.off_tx, m);
    const uint32_t tx = (uint32_t)*tx_word;
    const int* head = rword(s, s.off_head, m);
    uint8_t* stage = rbuf(s) + s.off_send + (uint64_t)m * s.ring_bytes;
    const uint64_t ring = raddr(s, m) + s.off_recv + (uint64_t)s.node * s.ring_bytes;
    const uint64_t tail = raddr(s, m) + 4ull * s.off_tail + 4ull * s.node;
    const uint64_t fetch = s.buf + 4ull * s.off_fetch;
    gda::Qp* qp = relay_qp(s, m, 0);
    const int Q = a.ring_tokens;
    // Start on an empty ring: the previous call's rows (of any size) were all consumed.
    if (const int w = block_wait(s, m, head, tx, &flag)) {
        if (threadIdx.x == 0 && w == kTimedOut) relay_error(s, kErrPeerTimeout, column_peer(s, m), a.phase, -1);
        return;
    }
    for (int i = 0; i < n; i += a.chunk_tokens) {
        const int k = min(a.chunk_tokens, n - i);
        const uint32_t first = tx + (uint32_t)i;
        // Room: slot (first + k - 1) mod Q is free once head >= first + k - Q.
        if (const int w = block_wait(s, m, head, first + (uint32_t)k - (uint32_t)Q, &flag)) {
            if (threadIdx.x == 0 && w == kTimedOut) relay_error(s, kErrPeerTimeout, column_peer(s, m), a.phase, -1);
            return;
        }
        copy_rows(stage, rows + (uint64_t)i * a.row_bytes, k, a.row_bytes, true, false, first, Q);
        __threadfence_system();   // staged rows visible to the NIC before the doorbell
        __syncthreads();
        if (threadIdx.x == 0) {
            const uint32_t s0 = first % (uint32_t)Q;
            const int run = min(k, Q - (int)s0);
            int st = gda::post_rdma_write(qp, reinterpret_cast<uint64_t>(stage) + (uint64_t)s0 * a.row_bytes, s.lkey,
                                          ring + (uint64_t)s0 * a.row_bytes, rkey(s, m),
                                          (uint32_t)run * a.row_bytes, false, s.timeout_ns);
            if (st == gda::kOk && k > run)
                st = gda::post_rdma_write(qp, reinterpret_cast<uint64_t>(stage), s.lkey, ring, rkey(s, m),
                                          (uint32_t)(k - run) * a.row_bytes, false, s.timeout_ns);
            if (st == gda::kOk)
                st = gda::post_masked_fa32(qp, tail, rkey(s, m), (uint32_t)k, fetch, s.lkey, false, s.timeout_ns);
            flag = st;
            if (st != gda::kOk) qp_failed(s, qp, m, st, a.phase);
        }
        __syncthreads();
        if (flag != gda::kOk) return;
    }
    // Every WQE of this call completed (or its error CQE is reported now, not at a later call).
    if (threadIdx.x == 0) {
        const int st = gda::quiet(qp, s.timeout_ns);
        if (st != gda::kOk) qp_failed(s, qp, m, st, a.phase);
        *tx_word = (int)(tx + (uint32_t)n);
    }
}

struct RecvShared {
    int flag, avail;
};
__device__ void relay_recv(const RelayStatic& s, const RelayArgs& a, int m) {
    RecvShared& sh = block_shared<RecvShared>();
    int& flag = sh.flag;
    int& avail = sh.avail;
    const int* off = reinterpret_cast<const int*>(a.recv_offsets);
    const int n = off[m + 1] - off[m];
    uint8_t* out = reinterpret_cast<uint8_t*>(a.dst) + (uint64_t)off[m] * a.row_bytes;
    int* rx_word = rword(s, s.off_rx, m);
    const uint32_t rx = (uint32_t)*rx_word;
    const int* tail = rword(s, s.off_tail, m);
    const uint8_t* ring = rbuf(s) + s.off_recv + (uint64_t)m * s.ring_bytes;
    const uint64_t head = raddr(s, m) + 4ull * s.off_head + 4ull * s.node;
    const uint64_t fetch = s.buf + 4ull * s.off_fetch;
    gda::Qp* qp = relay_qp(s, m, 1);   // a second QP where there is one: head returns beside the data
    int done = 0;
    while (done < n) {
        if (const int w = block_wait(s, m, tail, rx + (uint32_t)done + 1, &flag)) {
            if (threadIdx.x == 0 && w == kTimedOut) relay_error(s, kErrPeerTimeout, column_peer(s, m), a.phase, -1);
            return;
        }
        if (threadIdx.x == 0) avail = min(n - done, (int)((uint32_t)ld_acquire_sys(tail) - (rx + (uint32_t)done)));
        __syncthreads();
        const int k = avail;
        // Ring reads are .cg (normal_common.cuh warp_copy): the NIC rewrites slots this SM may have cached.
        // Rows past dst_capacity (a count beyond num_worst_tokens' bound, recorded by the caller's
        // kernels) are consumed but dropped, so the counters of both ends stay equal.
        const int keep = a.dst_capacity > 0 ? max(0, a.dst_capacity - (off[m] + done)) : k;
        copy_rows(out + (uint64_t)done * a.row_bytes, ring, k, a.row_bytes, false, true, rx + (uint32_t)done, a.ring_tokens,
                  keep);
        __syncthreads();   // every read of these slots done before the head frees them
        if (threadIdx.x == 0) {
            const int st = gda::post_masked_fa32(qp, head, rkey(s, m), (uint32_t)k, fetch, s.lkey, false, s.timeout_ns);
            flag = st;
            if (st != gda::kOk) qp_failed(s, qp, m, st, a.phase);
        }
        __syncthreads();
        if (flag != gda::kOk) return;
        done += k;
    }
    if (threadIdx.x == 0) *rx_word = (int)(rx + (uint32_t)n);
}

// Block 2m sends to node m's column peer, block 2m + 1 receives from it (both idle for this node, and
// all of them in a call the count exchange found void: no rank of the column moves a row then). With a
// mask, a peer out of the call (the count exchange's kWsMask, less the peers marked since) gets no row
// and sends none: its runs of src and dst stay as they are (the staged path leaves them out).
__global__ void __launch_bounds__(kRelayThreads) relay_kernel(RelayStatic s, RelayArgs a) {
    const int m = blockIdx.x / 2;
    if (m == s.node || reinterpret_cast<const int*>(s.workspace)[kWsVoid]) return;
    if (s.active && !((relay_call_mask(s) >> m) & 1u)) return;
    if (blockIdx.x % 2 == 0)
        relay_send(s, a, m);
    else
        relay_recv(s, a, m);
}

// What the launchers check on the host before a launch (the CPU simulation calls them too).
void check_relay_counts(const RelayStatic& s, const RelayCountsArgs& a) {
    if (s.num_nodes < 2 || s.num_nodes > kMaxNodes) throw std::invalid_argument("relay: num_nodes out of range");
    if (a.host_counts && a.host_ticket <= 0) throw std::invalid_argument("relay counts: host_ticket must be > 0");
    if (!s.workspace || !s.tag_record)
        throw std::invalid_argument("relay counts: the static has no workspace (the call counter) or tag record");
    if (a.status < kTagOk || a.status > kTagRefused) throw std::invalid_argument("relay counts: status must be OK or REFUSED");
}

void check_relay(const RelayStatic& s, const RelayArgs& a) {
    if (s.num_nodes < 2 || s.num_nodes > kMaxNodes) throw std::invalid_argument("relay: num_nodes out of range");
    if (a.row_bytes <= 0 || a.row_bytes % 16) throw std::invalid_argument("relay: row_bytes must be a positive multiple of 16");
    if (a.ring_tokens < 1 || (uint64_t)a.ring_tokens * a.row_bytes > s.ring_bytes)
        throw std::invalid_argument("relay: ring_tokens * row_bytes exceeds the relay ring");
    if (a.chunk_tokens < 1 || a.chunk_tokens > a.ring_tokens)
        throw std::invalid_argument("relay: chunk_tokens must be in [1, ring_tokens]");
}

#if !defined(PYEP_LL_CPU_SIM)
void check_launch(const char* what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

#endif  // !PYEP_LL_CPU_SIM

}  // namespace

#if !defined(PYEP_LL_CPU_SIM)
void launch_relay_counts(const RelayStatic& s, const RelayCountsArgs& a, uint64_t stream) {
    check_relay_counts(s, a);
    relay_counts_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check_launch("relay_counts_kernel");
}

void launch_relay(const RelayStatic& s, const RelayArgs& a, uint64_t stream) {
    check_relay(s, a);
    relay_kernel<<<2 * s.num_nodes, kRelayThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    check_launch("relay_kernel");
}
#endif  // !PYEP_LL_CPU_SIM

}  // namespace normal
}  // namespace pyep
