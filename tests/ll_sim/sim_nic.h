// The in-process NIC of the CPU simulations (ll_sim.cpp, relay_sim.cpp): the qp.h queue pairs of every
// ordered rank pair, executed by one host thread -- RDMA writes as memcpy, masked FA32 as an atomic add,
// one CQE per doorbell -- which also checks every key (rkey/lkey = 1000 + rank) and address range.
// Include after cuda_shim.h and the kernel sources (it needs gda::, prm:: and nic::).
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mlx5gda/provider.h"

namespace pyep {

// The in-process NIC: a full mesh of RC QPs (num_qps per ordered pair), executed by one thread.
class SimNic {
  public:
    // lag_ns[j] (optional): QP j of every pair executes a doorbell's WQEs only that long after it saw
    // them, so the QPs of one peer complete out of step (RC orders one QP's WQEs, never two QPs').
    SimNic(std::vector<uint64_t> bufs, std::vector<uint64_t> sizes, int nqp, int log_sq,
           std::vector<uint64_t> lag_ns = {})
        : bufs_(std::move(bufs)), sizes_(std::move(sizes)), nqp_(nqp), log_sq_(log_sq), lag_ns_(std::move(lag_ns)) {
        const int R = (int)bufs_.size();
        ctx_.resize(R);
        for (int r = 0; r < R; ++r) {
            ctx_[r] = static_cast<gda::Qp*>(std::aligned_alloc(64, sizeof(gda::Qp) * R * nqp));
            std::memset(ctx_[r], 0, sizeof(gda::Qp) * R * nqp);
            for (int d = 0; d < R; ++d) {
                if (d == r) continue;
                for (int j = 0; j < nqp; ++j) {
                    Q q;
                    q.src = r;
                    q.dst = d;
                    q.lag_ns = j < (int)lag_ns_.size() ? lag_ns_[j] : 0;
                    q.sq = alloc((size_t)64 << log_sq);
                    q.dbrec = reinterpret_cast<uint32_t*>(alloc(64));
                    q.bf = alloc(512);
                    q.cqes = reinterpret_cast<prm::Cqe64*>(alloc((size_t)64 << log_sq));
                    q.cq_dbrec = reinterpret_cast<uint32_t*>(alloc(64));
                    for (uint32_t k = 0; k < (1u << log_sq); ++k) q.cqes[k].op_own = (uint8_t)((prm::kCqeInvalid << 4) | 1);
                    nic::QpInfo qi;
                    qi.qpn = (uint32_t)(0x100 + queues_.size());
                    qi.log_sq = (uint32_t)log_sq;
                    qi.sq = q.sq;
                    qi.dbrec = q.dbrec;
                    qi.bf = q.bf;
                    qi.bf_size = 256;
                    nic::CqInfo ci;
                    ci.cqes = q.cqes;
                    ci.dbrec = q.cq_dbrec;
                    ci.log_size = (uint32_t)log_sq;
                    q.qpn = qi.qpn;
                    ctx_[r][d * nqp + j] = nic::make_qp_context(qi, ci);
                    queues_.push_back(q);
                }
            }
        }
        thread_ = std::thread([this] {
            while (running_.load()) {
                if (!progress()) std::this_thread::yield();
            }
        });
    }
    ~SimNic() {
        running_ = false;
        thread_.join();
        for (void* p : mem_) std::free(p);
        for (auto* c : ctx_) std::free(c);
    }
    uint64_t contexts(int rank) const { return reinterpret_cast<uint64_t>(ctx_.at(rank)); }
    std::vector<std::string> errors() {
        std::lock_guard<std::mutex> g(err_m_);
        return errors_;
    }
    uint64_t executed() const { return executed_.load(); }
    // Every doorbell rung so far has been executed (tests wait for this after the launches returned).
    bool idle() const {
        for (const Q& q : queues_) {
            const uint32_t raw = __atomic_load_n(&q.dbrec[prm::kSendDbr], __ATOMIC_ACQUIRE);
            if ((uint16_t)gda::be32toh_(raw) != (uint16_t)__atomic_load_n(&q.pi, __ATOMIC_ACQUIRE)) return false;
        }
        return true;
    }

  private:
    struct Q {
        int src = 0, dst = 0;
        uint32_t qpn = 0;
        uint8_t* sq = nullptr;
        uint32_t* dbrec = nullptr;
        uint8_t* bf = nullptr;
        prm::Cqe64* cqes = nullptr;
        uint32_t* cq_dbrec = nullptr;
        uint64_t pi = 0, cq_pi = 0;
        uint64_t lag_ns = 0, seen_ns = 0;   // seen_ns: when the pending doorbell was first seen
    };
    uint8_t* alloc(size_t n) {
        void* p = std::aligned_alloc(64, (n + 63) / 64 * 64);
        std::memset(p, 0, n);
        mem_.push_back(p);
        return static_cast<uint8_t*>(p);
    }
    void error(const std::string& e) {
        std::lock_guard<std::mutex> g(err_m_);
        if (errors_.size() < 20) errors_.push_back(e);
    }
    bool inside(int rank, uint64_t addr, uint64_t len) const {
        return addr >= bufs_[rank] && addr + len <= bufs_[rank] + sizes_[rank];
    }
    bool progress() {
        bool any = false;
        for (Q& q : queues_) {
            const uint32_t raw = __atomic_load_n(&q.dbrec[prm::kSendDbr], __ATOMIC_ACQUIRE);
            const uint16_t delta = (uint16_t)((uint16_t)gda::be32toh_(raw) - (uint16_t)q.pi);
            if (delta == 0) continue;
            any = true;
            if (q.lag_ns) {
                const uint64_t now = gda::now_ns();
                if (q.seen_ns == 0) q.seen_ns = now;
                if (now - q.seen_ns < q.lag_ns) continue;
                q.seen_ns = 0;
            }
            const uint64_t mask = (1ull << log_sq_) - 1;
            for (uint16_t i = 0; i < delta; ++i) execute(q, gda::decode_wqe(q.sq + ((q.pi + i) & mask) * 64));
            __atomic_store_n(&q.pi, q.pi + delta, __ATOMIC_RELEASE);   // idle() reads it
            prm::Cqe64* cqe = &q.cqes[q.cq_pi & mask];
            gda::DecodedCqe d{};
            d.opcode = prm::kCqeReq;
            d.wqe_counter = (uint16_t)(q.pi - 1);
            d.qpn = q.qpn;
            gda::encode_cqe_body(cqe, d);
            const uint8_t owner = (uint8_t)((q.cq_pi >> log_sq_) & 1);
            __atomic_store_n(&cqe->op_own, gda::cqe_op_own(prm::kCqeReq, owner), __ATOMIC_RELEASE);
            ++q.cq_pi;
        }
        return any;
    }
    void execute(const Q& q, const gda::DecodedWqe& d) {
        const auto& wr = d.wr;
        const std::string where = "QP " + std::to_string(q.src) + "->" + std::to_string(q.dst) + ": ";
        if (d.opcode == prm::kOpNop) return;
        if (wr.rkey != 1000u + q.dst) error(where + "rkey " + std::to_string(wr.rkey));
        if (wr.lkey != 1000u + q.src) error(where + "lkey " + std::to_string(wr.lkey));
        if (d.opcode == prm::kOpRdmaWrite) {
            if (!inside(q.src, wr.laddr, wr.length) || !inside(q.dst, wr.raddr, wr.length)) {
                error(where + "write outside the buffers");
                return;
            }
            std::memcpy(reinterpret_cast<void*>(wr.raddr), reinterpret_cast<const void*>(wr.laddr), wr.length);
        } else if (d.opcode == prm::kOpAtomicMaskedFa) {
            if (!inside(q.src, wr.laddr, 4) || !inside(q.dst, wr.raddr, 4) || wr.raddr % 4) {
                error(where + "atomic outside the buffers");
                return;
            }
            const uint32_t old = __atomic_fetch_add(reinterpret_cast<uint32_t*>(wr.raddr), (uint32_t)wr.add, __ATOMIC_SEQ_CST);
            std::memcpy(reinterpret_cast<void*>(wr.laddr), &old, 4);
        } else {
            error(where + "unexpected opcode " + std::to_string(d.opcode));
        }
        executed_.fetch_add(1);
    }

    std::vector<uint64_t> bufs_, sizes_;
    int nqp_, log_sq_;
    std::vector<uint64_t> lag_ns_;
    std::vector<gda::Qp*> ctx_;
    std::vector<Q> queues_;
    std::vector<void*> mem_;
    std::atomic<bool> running_{true};
    std::atomic<uint64_t> executed_{0};
    std::mutex err_m_;
    std::vector<std::string> errors_;
    std::thread thread_;
};

}  // namespace pyep
