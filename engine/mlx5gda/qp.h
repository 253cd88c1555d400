// GPU-direct-async posting on an mlx5 RC send queue: the per-QP device context, slot reservation,
// doorbells, send-CQ polling and the per-QP error slot. Header-only and __host__ __device__: GPU
// kernels post through it, and so do CPU threads in tests (driving the softnic) — one code path.
//
// Concurrency: many threads (one lane per warp on the GPU) may post to one QP at once. Posting is
// lock-free in the common case:
//   1. reserve: fetch-add on `resv` claims WQEBB indices [start, start+n). The poster then waits until
//      the ring has room (start+n - cons <= ring size), polling the send CQ itself if it has to.
//   2. write the WQE(s) into the claimed slots; nobody else touches them.
//   3. commit: wait until `ready == start` (everyone before us has rung), then publish: a system fence
//      (WQE stores before the DBR), the DBR store, a fence, the 8-byte BlueFlame store, then
//      `ready = start+n` (release). Doorbells therefore go out in producer-index order, which mlx5
//      requires (the DBR value is a counter, not a bitmap), while WQE writing proceeds in parallel.
// Chosen over a mutex around the whole post because the expensive part (building and storing the
// WQE, 64 B over PCIe when the ring is host-mapped) then overlaps across warps; only the few stores
// of step 3 are serialised. CQ polling uses a try-lock: one poller at a time, others just re-check.
//
// Reclaiming: mlx5 writes a CQE only for WQEs with CQ_UPDATE. A poster that never asks for CQEs would
// fill the ring and wait forever, so a post whose WQEBBs reach a multiple of (ring/4) is always
// signaled. Then at most ring/4 - 1 completed slots can be unaccounted for, and any batch of at most
// 3/4 of the ring eventually fits (`kMaxBatchFraction`).
#pragma once

#include "mlx5gda/portable.h"
#include "mlx5gda/prm.h"
#include "mlx5gda/wqe.h"

namespace pyep {
namespace gda {

enum Status : int {
    kOk = 0,
    kErrQp = 1,       // the QP is in error; QpError says why (a CQE error or an earlier timeout)
    kErrTimeout = 2,  // this call timed out; the QP has been put in error
    kErrInvalid = 3,  // bad request (opcode, batch larger than the ring allows)
};

enum ErrorKind : uint16_t {
    kErrKindNone = 0,
    kErrKindCqe = 1,          // an error CQE arrived (syndrome/vendor_syndrome valid)
    kErrKindRingTimeout = 2,  // no ring space in time: completions stopped coming
    kErrKindOrderTimeout = 3, // an earlier poster never rang its doorbell in time
    kErrKindQuietTimeout = 4, // quiet(): posted WQEs did not complete in time
};

struct QpError {
    uint32_t valid;            // 0 = healthy; set once (first error wins)
    uint16_t kind;             // ErrorKind
    uint8_t cqe_opcode;        // prm::CqeOpcode of the error CQE
    uint8_t syndrome;          // MLX5_CQE_SYNDROME_*
    uint8_t vendor_syndrome;
    uint8_t wqe_opcode;        // opcode of the WQE that failed (s_wqe_opcode)
    uint16_t wqe_counter;      // its WQE index
    uint64_t when_ns;          // now_ns() when recorded
};

struct SendCq {
    prm::Cqe64* cqes;   // ring of 2^log_size CQEs, pre-set to INVALID with owner 1
    uint32_t* dbrec;    // CQ doorbell record: be32 set_ci, be32 arm
    uint32_t log_size;
    uint32_t lock;      // try-lock: one poller at a time
    uint64_t ci;        // consumer index (protected by lock)
};

// Per-QP device context. Lives in memory the posting threads can do atomics on (GPU memory for GPU
// posters); the rings it points to live wherever the NIC/softnic can read them.
struct Qp {
    uint32_t qpn;
    uint32_t log_sq;       // ring holds 2^log_sq WQEBBs
    uint8_t* sq;           // ring base
    uint32_t* dbrec;       // QP doorbell record: [MLX5_RCV_DBR], [MLX5_SND_DBR], be32 each
    uint8_t* bf;           // BlueFlame/UAR register: two halves of bf_size bytes
    uint32_t bf_size;
    uint32_t bf_offset;    // which half the next doorbell goes to (only touched while "ordered")
    uint64_t resv;         // WQEBBs reserved so far
    uint64_t ready;        // WQEBBs made visible to the NIC (doorbell rung), in order
    uint64_t cons;         // WQEBBs known complete (reclaimed from the CQ)
    uint64_t signaled;     // end index of the last WQE that asked for a CQE
    uint64_t wqes_posted;  // statistics for diagnostics (`pyep qp`)
    uint64_t bytes_posted;
    SendCq cq;
    QpError err;
};

constexpr uint32_t kMaxBatchFraction = 4;  // a batch may use at most 3/4 of the ring

PYEP_HD uint32_t sq_size(const Qp* qp) { return 1u << qp->log_sq; }
PYEP_HD uint32_t signal_chunk(const Qp* qp) {
    const uint32_t c = sq_size(qp) / kMaxBatchFraction;
    return c ? c : 1;
}
PYEP_HD bool qp_in_error(const Qp* qp) { return load_acquire_u32(&qp->err.valid) != 0; }

// Records the first error of a QP; later posts fail fast. Returns true if this call recorded it.
PYEP_HD bool mark_qp_error(Qp* qp, uint16_t kind, uint8_t cqe_opcode, uint8_t syndrome,
                           uint8_t vendor_syndrome, uint8_t wqe_opcode, uint16_t wqe_counter) {
    if (atomic_cas_u32(&qp->err.valid, 0, 1) != 0) return false;
    qp->err.kind = kind;
    qp->err.cqe_opcode = cqe_opcode;
    qp->err.syndrome = syndrome;
    qp->err.vendor_syndrome = vendor_syndrome;
    qp->err.wqe_opcode = wqe_opcode;
    qp->err.wqe_counter = wqe_counter;
    qp->err.when_ns = now_ns();
    return true;
}

// Consumes the send CQ; advances `cons`. Returns the number of CQEs consumed (0 if another thread
// holds the poll lock). Error CQEs are decoded into the QP's error slot.
PYEP_HD int poll_send_cq(Qp* qp) {
    if (atomic_cas_u32(&qp->cq.lock, 0, 1) != 0) return 0;
    fence_system();  // acquire side of the lock, and order CQE reads after it
    SendCq& cq = qp->cq;
    const uint32_t cq_mask = (1u << cq.log_size) - 1;
    const uint32_t sq_mask = sq_size(qp) - 1;
    uint64_t ci = cq.ci;
    uint64_t cons = qp->cons;
    int n = 0;
    for (; n < 64; ++n) {
        prm::Cqe64* cqe = &cq.cqes[ci & cq_mask];
        // Bytes 60..63 are {wqe_counter be16, signature, op_own}: one acquire load gets the owner bit
        // and the counter together, and orders the reads of the rest of the CQE after it.
        const uint32_t tail = load_acquire_sys_u32(reinterpret_cast<const uint32_t*>(&cqe->wqe_counter));
        const uint8_t op_own = (uint8_t)(tail >> 24);
        const uint8_t opcode = op_own >> 4;
        if (opcode == prm::kCqeInvalid || (op_own & prm::kCqeOwnerMask) != ((ci >> cq.log_size) & 1)) break;
        const uint16_t counter = bswap16((uint16_t)(tail & 0xffff));
        const uint64_t idx = cons + (uint16_t)(counter - (uint16_t)cons);
        if (opcode == prm::kCqeReqErr || opcode == prm::kCqeRespErr) {
            const uint8_t* b = reinterpret_cast<const uint8_t*>(cqe);
            const uint32_t sdq = be32toh_(cqe->sop_drop_qpn);
            mark_qp_error(qp, kErrKindCqe, opcode, b[prm::kErrCqeSyndromeOffset],
                          b[prm::kErrCqeVendorSyndOffset], (uint8_t)(sdq >> 24), counter);
        }
        // The completed WQE is still in the ring (its slots are not reclaimed yet): its ds says how
        // many WQEBBs it spans.
        const uint32_t qpn_ds = be32toh_(reinterpret_cast<const uint32_t*>(qp->sq + (idx & sq_mask) * prm::kSendWqeBB)[1]);
        cons = idx + wqebbs_for_ds(qpn_ds & 0x3f);
        ++ci;
    }
    if (n) {
        cq.ci = ci;
        store_relaxed_sys_u32(&cq.dbrec[prm::kCqDbrSetCi], htobe32_((uint32_t)(ci & prm::kCqCiMask)));
        store_release_u64(&qp->cons, cons);
    }
    fence_system();
    store_release_u32(&qp->cq.lock, 0);
    return n;
}

// Claims `n` WQEBBs and waits for ring space. Deadline is absolute now_ns(); 0 = compute from timeout.
PYEP_HD int reserve_wqebbs(Qp* qp, uint32_t n, uint64_t timeout_ns, uint64_t* start_out) {
    if (n == 0 || n > sq_size(qp) - signal_chunk(qp)) return kErrInvalid;
    if (qp_in_error(qp)) return kErrQp;
    const uint64_t start = atomic_fetch_add_u64(&qp->resv, n);
    uint64_t deadline = 0;
    while (start + n - load_acquire_u64(&qp->cons) > sq_size(qp)) {
        poll_send_cq(qp);
        if (qp_in_error(qp)) return kErrQp;
        const uint64_t t = now_ns();
        if (!deadline) deadline = t + timeout_ns;
        if (t > deadline) {
            mark_qp_error(qp, kErrKindRingTimeout, 0, 0, 0, 0, (uint16_t)start);
            return kErrTimeout;
        }
        spin_pause();
    }
    *start_out = start;
    return kOk;
}

// Rings the doorbell for [start, start+n) once every earlier reservation has rung. `last_ctrl` is
// the WQEBB holding the last WQE's ctrl segment (its first 8 bytes go to the BlueFlame register).
PYEP_HD int ring_doorbell(Qp* qp, uint64_t start, uint32_t n, bool signaled, uint64_t timeout_ns,
                          uint64_t bytes = 0) {
    uint64_t deadline = 0;
    while (load_acquire_u64(&qp->ready) != start) {
        if (qp_in_error(qp)) return kErrQp;
        const uint64_t t = now_ns();
        if (!deadline) deadline = t + timeout_ns;
        if (t > deadline) {
            mark_qp_error(qp, kErrKindOrderTimeout, 0, 0, 0, 0, (uint16_t)start);
            return kErrTimeout;
        }
        spin_pause();
    }
    const uint64_t end = start + n;
    const uint8_t* last = qp->sq + ((end - 1) & (sq_size(qp) - 1)) * prm::kSendWqeBB;
    fence_system();  // WQE stores (ours, and those ordered before us via `ready`) before the DBR
    store_relaxed_sys_u32(&qp->dbrec[prm::kSendDbr], htobe32_((uint32_t)(end & 0xffff)));
    fence_system();  // DBR before the BlueFlame write: the NIC may fetch WQEs as soon as it sees it
    store_mmio_u64(reinterpret_cast<uint64_t*>(qp->bf + qp->bf_offset), *reinterpret_cast<const uint64_t*>(last));
    qp->bf_offset ^= qp->bf_size;
    if (signaled) qp->signaled = end;
    // Statistics ride in the ordered section (one poster at a time), so they need no atomics.
    qp->wqes_posted += n;
    qp->bytes_posted += bytes;
    store_release_u64(&qp->ready, end);
    return kOk;
}

// Posts up to `n` work requests with one doorbell. Every request is one WQEBB.
// `end_out` (optional) receives the producer index just past the batch.
PYEP_HD int post_batch(Qp* qp, const WorkRequest* wrs, uint32_t n, uint64_t timeout_ns,
                       uint64_t* end_out = nullptr) {
    for (uint32_t i = 0; i < n; ++i)
        if (wqe_ds(wrs[i].opcode) == 0) return kErrInvalid;
    uint64_t start;
    int st = reserve_wqebbs(qp, n, timeout_ns, &start);
    if (st != kOk) return st;
    const uint64_t end = start + n;
    const uint32_t chunk = signal_chunk(qp);
    const bool force_signal = (start / chunk) != (end / chunk);
    bool signaled = false;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; ++i) {
        WorkRequest wr = wrs[i];
        if (i + 1 == n && force_signal) wr.signaled = true;
        signaled |= wr.signaled;
        if (wr.opcode == prm::kOpRdmaWrite) bytes += wr.length;
        WqeWords words;
        encode_wqe(wr, (uint16_t)(start + i), qp->qpn, &words);
        store_wqebb(qp->sq + ((start + i) & (sq_size(qp) - 1)) * prm::kSendWqeBB, words);
    }
    st = ring_doorbell(qp, start, n, signaled, timeout_ns, bytes);
    if (end_out) *end_out = end;
    return st;
}

PYEP_HD int post_rdma_write(Qp* qp, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                            uint32_t length, bool signaled, uint64_t timeout_ns) {
    WorkRequest wr;
    wr.opcode = prm::kOpRdmaWrite;
    wr.signaled = signaled;
    wr.laddr = laddr; wr.lkey = lkey; wr.raddr = raddr; wr.rkey = rkey; wr.length = length;
    return post_batch(qp, &wr, 1, timeout_ns);
}

// 32-bit fetch-add at raddr (ATOMIC_MASKED_FA, 4-byte extended atomic). The old value lands at laddr.
PYEP_HD int post_masked_fa32(Qp* qp, uint64_t raddr, uint32_t rkey, uint32_t add, uint64_t fetch_laddr,
                             uint32_t fetch_lkey, bool signaled, uint64_t timeout_ns) {
    WorkRequest wr;
    wr.opcode = prm::kOpAtomicMaskedFa;
    wr.signaled = signaled;
    wr.raddr = raddr; wr.rkey = rkey; wr.add = add; wr.laddr = fetch_laddr; wr.lkey = fetch_lkey;
    return post_batch(qp, &wr, 1, timeout_ns);
}

PYEP_HD int post_fa64(Qp* qp, uint64_t raddr, uint32_t rkey, uint64_t add, uint64_t fetch_laddr,
                      uint32_t fetch_lkey, bool signaled, uint64_t timeout_ns) {
    WorkRequest wr;
    wr.opcode = prm::kOpAtomicFa;
    wr.signaled = signaled;
    wr.raddr = raddr; wr.rkey = rkey; wr.add = add; wr.laddr = fetch_laddr; wr.lkey = fetch_lkey;
    return post_batch(qp, &wr, 1, timeout_ns);
}

PYEP_HD int post_nop(Qp* qp, bool signaled, uint64_t timeout_ns) {
    WorkRequest wr;
    wr.opcode = prm::kOpNop;
    wr.signaled = signaled;
    return post_batch(qp, &wr, 1, timeout_ns);
}

// RDMA write followed by a 32-bit signal add on the same QP, one doorbell. RC executes a QP's WQEs in
// order and the responder applies them in order, so the signal is visible only after the data.
PYEP_HD int post_write_with_signal(Qp* qp, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                   uint32_t length, uint64_t sig_raddr, uint32_t sig_rkey, uint32_t add,
                                   uint64_t fetch_laddr, uint32_t fetch_lkey, bool signaled, uint64_t timeout_ns) {
    WorkRequest wrs[2];
    wrs[0].opcode = prm::kOpRdmaWrite;
    wrs[0].laddr = laddr; wrs[0].lkey = lkey; wrs[0].raddr = raddr; wrs[0].rkey = rkey; wrs[0].length = length;
    wrs[1].opcode = prm::kOpAtomicMaskedFa;
    wrs[1].signaled = signaled;
    wrs[1].raddr = sig_raddr; wrs[1].rkey = sig_rkey; wrs[1].add = add;
    wrs[1].laddr = fetch_laddr; wrs[1].lkey = fetch_lkey;
    return post_batch(qp, wrs, 2, timeout_ns);
}

// Waits until everything posted so far has completed. If the last WQE did not ask for a CQE, a
// signaled NOP is posted so that completion becomes observable.
PYEP_HD int quiet(Qp* qp, uint64_t timeout_ns) {
    if (qp_in_error(qp)) return kErrQp;
    uint64_t target = load_acquire_u64(&qp->ready);
    if (load_acquire_u64(&qp->resv) != target || load_acquire_u64(&qp->signaled) != target) {
        // Either someone is mid-post (their WQE may be unsignaled) or the tail is unsignaled: a
        // signaled NOP behind them completes only after them (in-order execution).
        WorkRequest nop;
        nop.opcode = prm::kOpNop;
        nop.signaled = true;
        const int st = post_batch(qp, &nop, 1, timeout_ns, &target);
        if (st != kOk) return st;
    }
    uint64_t deadline = 0;
    while (load_acquire_u64(&qp->cons) < target) {
        poll_send_cq(qp);
        if (qp_in_error(qp)) return kErrQp;
        const uint64_t t = now_ns();
        if (!deadline) deadline = t + timeout_ns;
        if (t > deadline) {
            mark_qp_error(qp, kErrKindQuietTimeout, 0, 0, 0, 0, (uint16_t)target);
            return kErrTimeout;
        }
        spin_pause();
    }
    return kOk;
}

}  // namespace gda
}  // namespace pyep
