// The softnic's data path, part 1: the progress thread, doorbells, in-order retirement and CQEs.
// Part 2 (softnic_exec.cpp) checks and executes one WQE as the requester and responder NICs would.
//
// Per QP, WQEs are fetched in producer order. A fetched WQE either completes at once (host memory,
// errors, flushes) or is queued on the QP's CUDA stream; either way it becomes a Completion in the
// QP's `pending` queue, which is retired strictly in order, so a CQE (which lets the poster reclaim
// every earlier slot) is only written once all earlier WQEs have finished. Work that runs on the host
// never overtakes work still queued on the stream: such a WQE waits (the QP stalls) until the stream
// has caught up, so "data, then signal" holds across backends.
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "mlx5gda/softnic_internal.h"

namespace pyep {
namespace nic {

using namespace softnic;
using Impl = SoftNicProvider::Impl;

namespace {

uint16_t load_send_dbr(const QpObj& q) {
    const auto* dbr = reinterpret_cast<const uint32_t*>(q.db.host);
    return (uint16_t)(gda::be32toh_(__atomic_load_n(&dbr[prm::kSendDbr], __ATOMIC_ACQUIRE)) & 0xffff);
}

void copy_wqebbs(const QpObj& q, uint64_t index, uint32_t count, uint8_t* out) {
    const uint32_t mask = (1u << q.log_sq) - 1;
    for (uint32_t i = 0; i < count; ++i)
        std::memcpy(out + i * prm::kSendWqeBB, q.sq.host + ((index + i) & mask) * prm::kSendWqeBB, prm::kSendWqeBB);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

void Impl::thread_main() {
    pthread_setname_np(pthread_self(), "pyep-softnic");
    if (cuda) {
        cuda->set_device(device);
        // A graph captured by the application thread must not be broken by this thread's event queries.
        if (!cuda->isolate_from_captures()) {
            std::lock_guard<std::mutex> lk(mu);
            event("progress thread: " + cuda->last_error());
        }
    }
    uint32_t idle = 0;
    while (running.load(std::memory_order_relaxed)) {
        uint32_t work;
        {
            std::lock_guard<std::mutex> lk(mu);
            work = pass();
        }
        // A control call is waiting for the lock: let it have it before the next pass.
        while (ctl_waiting.load() > 0 && running.load(std::memory_order_relaxed)) std::this_thread::yield();
        if (work) {
            idle = 0;
        } else if (++idle > opt.idle_spin) {
            std::this_thread::sleep_for(std::chrono::microseconds(opt.idle_sleep_us));
        } else {
            std::this_thread::yield();
        }
    }
}

uint32_t Impl::pass() {
    const uint64_t now = gda::now_ns();
    uint32_t work = 0;
    for (auto& [qpn, q] : qps) work += service_qp(*q, now);
    return work;
}

uint32_t Impl::service_qp(QpObj& q, uint64_t now) {
    uint32_t work = retire(q);
    const uint32_t ring = 1u << q.log_sq;
    uint32_t fetched = 0;
    while (fetched < kFetchBudget) {
        const uint16_t dbr = load_send_dbr(q);
        if (dbr != q.last_dbr) {
            q.last_dbr = dbr;
            ++q.stats.doorbells;
        }
        const uint32_t avail = (uint16_t)(dbr - (uint16_t)q.ci);
        if (!avail) break;
        if (avail > ring) {
            if (q.state != prm::kQpsErr) {
                Completion c;
                c.wqe_index = (uint16_t)q.ci;
                fail(q, c, prm::kSyndLocalQpOpErr, kVendBadDoorbell,
                     "send doorbell " + std::to_string(dbr) + " is " + std::to_string(avail) +
                         " WQEBBs ahead of the consumer, more than the ring holds (" + std::to_string(ring) + ")");
            }
            break;
        }
        uint8_t wqe[16 * prm::kSendWqeBB];
        copy_wqebbs(q, q.ci, 1, wqe);
        const uint8_t ds = wqe[7] & 0x3f;  // low bits of qpn_ds (be32 at bytes 4..7)
        const uint32_t nbb = ds ? gda::wqebbs_for_ds(ds) : 1;
        if (nbb > avail) break;  // the rest of a multi-WQEBB WQE has not been rung yet
        if (nbb > 1) copy_wqebbs(q, q.ci + 1, nbb - 1, wqe + prm::kSendWqeBB);
        if (execute(q, wqe, now) == Step::Stall) break;
        q.ci += nbb;
        ++fetched;
    }
    if (q.cuda_unrecorded) {
        q.cuda_unrecorded = false;
        void* ev = cuda->record_event(q.stream);
        if (ev) {
            for (auto it = q.pending.rbegin(); it != q.pending.rend(); ++it)
                if (it->cuda) {
                    it->event = ev;
                    break;
                }
        } else {
            event("QP " + hex(q.qpn) + ": cannot record a CUDA event (" + cuda->last_error() +
                  "); waiting for the stream instead");
            cuda->sync_stream(q.stream, 10000000000ull);
            for (auto& c : q.pending) c.cuda = false;
        }
    }
    return work + fetched + retire(q);
}

Step Impl::fail(QpObj& q, Completion c, uint8_t syndrome, uint8_t vendor, const std::string& why) {
    c.error = true;
    c.syndrome = syndrome;
    c.vendor = vendor;
    q.pending.push_back(c);
    q.head_seen_ns = q.head_retry_ns = 0;
    ++q.stats.errors;
    q.stats.last_syndrome = syndrome;
    q.stats.last_vendor_syndrome = vendor;
    q.stats.last_error_wqe = c.wqe_index;
    const std::string msg = "node " + std::to_string(node_id) + " QP " + hex(q.qpn) + " WQE " +
                            std::to_string(c.wqe_index) + " (opcode " + hex(c.wqe_opcode) + "): syndrome " +
                            hex(syndrome) + " vendor " + hex(vendor) + ": " + why;
    q.stats.last_error = msg;
    event(msg);
    set_state(q, prm::kQpsErr);
    return Step::Done;
}

uint32_t Impl::retire(QpObj& q) {
    uint32_t n = 0;
    while (!q.pending.empty()) {
        if (q.pending.front().cuda) {
            size_t k = 0;
            while (k < q.pending.size() && !q.pending[k].event) ++k;
            if (k == q.pending.size()) break;  // its event is recorded at the end of this pass
            const int st = cuda->query_event(q.pending[k].event);
            if (st == 0) break;
            cuda->destroy_event(q.pending[k].event);
            q.pending[k].event = nullptr;
            for (size_t i = 0; i <= k; ++i) q.pending[i].cuda = false;
            if (st < 0) {
                // RC: the first failed WQE reports the error, everything after it is flushed.
                const std::string why = "CUDA work of QP " + hex(q.qpn) + " failed: " + cuda->last_error();
                bool first = true;
                for (auto& c : q.pending) {
                    if (c.event) cuda->destroy_event(c.event);
                    c.event = nullptr;
                    c.cuda = false;
                    c.copy_dst = nullptr;
                    if (c.error) continue;
                    c.error = true;
                    c.syndrome = first ? prm::kSyndRemoteOpErr : prm::kSyndWrFlushErr;
                    c.vendor = first ? kVendDma : kVendFlush;
                    first = false;
                }
                ++q.stats.errors;
                q.stats.last_error = why;
                event(why);
                set_state(q, prm::kQpsErr);
            }
        }
        const Completion c = q.pending.front();
        q.pending.pop_front();
        ++n;
        if (c.copy_dst) std::memcpy(c.copy_dst, q.scratch + c.copy_slot, c.copy_size);
        if (!c.signaled && !c.error) continue;
        gda::DecodedCqe d{};
        d.opcode = c.error ? prm::kCqeReqErr : prm::kCqeReq;
        d.syndrome = c.syndrome;
        d.vendor_syndrome = c.vendor;
        d.wqe_opcode = c.wqe_opcode;
        d.wqe_counter = c.wqe_index;
        d.qpn = q.qpn;
        d.byte_cnt = c.error ? 0 : c.byte_cnt;
        CqObj& cqo = cq(q.cqn);
        if (write_cqe(cqo, d)) ++q.stats.cqes;
    }
    return n;
}

bool Impl::write_cqe(CqObj& c, const gda::DecodedCqe& d) {
    if (c.overrun) return false;
    const auto* dbr = reinterpret_cast<const uint32_t*>(c.dbr.host);
    const uint32_t set_ci = gda::be32toh_(__atomic_load_n(&dbr[prm::kCqDbrSetCi], __ATOMIC_ACQUIRE)) & prm::kCqCiMask;
    const uint32_t outstanding = ((uint32_t)c.pi - set_ci) & prm::kCqCiMask;
    if (outstanding >= (1u << c.log_size)) {
        // Real hardware raises a CQ error (async event) and the QPs feeding the CQ stop: same here.
        c.overrun = true;
        c.error = "CQ " + std::to_string(c.cqn) + " overrun: " + std::to_string(outstanding) +
                  " CQEs not yet consumed (set_ci " + std::to_string(set_ci) + ") and the CQ holds " +
                  std::to_string(1u << c.log_size);
        event(c.error);
        std::fprintf(stderr, "pyep softnic node %llu: %s\n", (unsigned long long)node_id, c.error.c_str());
        for (auto& [qpn, q] : qps)
            if (q->cqn == c.cqn && q->state != prm::kQpsErr) {
                q->stats.last_error = c.error;
                set_state(*q, prm::kQpsErr);
            }
        return false;
    }
    auto* e = reinterpret_cast<prm::Cqe64*>(c.ring.host) + (c.pi & ((1u << c.log_size) - 1));
    gda::encode_cqe_body(e, d);
    // op_own hands the entry to the poller: it is written last, with release ordering.
    __atomic_store_n(&e->op_own, gda::cqe_op_own(d.opcode, (uint8_t)((c.pi >> c.log_size) & 1)), __ATOMIC_RELEASE);
    ++c.pi;
    return true;
}

}  // namespace nic
}  // namespace pyep
