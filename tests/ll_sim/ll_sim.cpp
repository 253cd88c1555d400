// CPU simulation of the low-latency EP kernels for CI (no GPU): engine/kernels/ll_*.cu compiled as host
// C++ against cuda_shim.h. Every simulated rank's grid runs at once, one OS thread per GPU thread,
// against host buffers; peers reach each other by direct stores (the NVLink/local path) or through
// qp.h queue pairs executed by a small in-process NIC (the IBGDA path: RDMA writes as memcpy, masked
// FA32 as an atomic add, one CQE per doorbell), which also checks every key and address range.
#define PYEP_LL_CPU_SIM 1
#include "cuda_shim.h"

#include "kernels/ll_combine.cu"
#include "kernels/ll_dispatch.cu"
#include "kernels/ll_runtime.cu"
#include "mlx5gda/provider.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <string>

namespace py = pybind11;
using namespace pyep;

namespace {

template <typename T>
void set(const py::dict& d, const char* key, T& field) {
    if (!d.contains(key)) throw py::key_error(std::string("missing field ") + key);
    field = d[key].cast<T>();
}

ll::LLStatic static_from(const py::dict& d) {
    ll::LLStatic s;
    set(d, "rank", s.rank); set(d, "num_ranks", s.num_ranks); set(d, "num_local_experts", s.num_local_experts);
    set(d, "num_max_tokens", s.num_max_tokens); set(d, "hidden", s.hidden); set(d, "max_topk", s.max_topk);
    set(d, "buf", s.buf); set(d, "peer_base", s.peer_base); set(d, "remote_addr", s.remote_addr);
    set(d, "rkeys", s.rkeys); set(d, "lkey", s.lkey); set(d, "qps", s.qps);
    set(d, "num_qps_per_peer", s.num_qps_per_peer); set(d, "flag_expect", s.flag_expect);
    set(d, "fetch_addr", s.fetch_addr); set(d, "workspace", s.workspace); set(d, "half_bytes", s.half_bytes);
    set(d, "off_dsig", s.off_dsig); set(d, "off_csig", s.off_csig); set(d, "off_cack", s.off_cack);
    set(d, "off_drecv", s.off_drecv);
    set(d, "off_crecv", s.off_crecv); set(d, "msg_bytes", s.msg_bytes); set(d, "slots_per_src", s.slots_per_src);
    set(d, "num_blocks", s.num_blocks);
    if (d.contains("err")) set(d, "err", s.err);   // the error record (host memory here), optional
    ll::check_static(s);
    return s;
}

ll::LLDispatchCall dispatch_from(const py::dict& d) {
    ll::LLDispatchCall c;
    set(d, "x", c.x); set(d, "topk", c.topk); set(d, "num_tokens", c.num_tokens); set(d, "num_topk", c.num_topk);
    set(d, "half", c.half); set(d, "use_fp8", c.use_fp8); set(d, "round_scale", c.round_scale);
    set(d, "use_ue8m0", c.use_ue8m0); set(d, "active", c.active); set(d, "recv_x", c.recv_x);
    set(d, "recv_scales", c.recv_scales); set(d, "src_info", c.src_info); set(d, "recv_slot", c.recv_slot);
    set(d, "layout_range", c.layout_range); set(d, "recv_count", c.recv_count); set(d, "cum_stats", c.cum_stats);
    set(d, "timeout_ns", c.timeout_ns); set(d, "phases", c.phases);
    if (d.contains("wait_stats")) set(d, "wait_stats", c.wait_stats);   // int64 [R] or 0, optional
    return c;
}

ll::LLCombineCall combine_from(const py::dict& d) {
    ll::LLCombineCall c;
    set(d, "x", c.x); set(d, "topk", c.topk); set(d, "weights", c.weights); set(d, "num_tokens", c.num_tokens);
    set(d, "num_topk", c.num_topk); set(d, "half", c.half); set(d, "src_info", c.src_info);
    set(d, "recv_slot", c.recv_slot); set(d, "layout_range", c.layout_range); set(d, "active", c.active);
    set(d, "out", c.out); set(d, "timeout_ns", c.timeout_ns); set(d, "phases", c.phases);
    if (d.contains("use_logfmt")) set(d, "use_logfmt", c.use_logfmt);
    if (d.contains("wait_stats")) set(d, "wait_stats", c.wait_stats);
    if (d.contains("repeat")) set(d, "repeat", c.repeat);
    return c;
}

// Runs one launch per listed rank, all at once; returns when every simulated thread has finished.
template <typename Call, typename Kernel>
void run_grids(const std::vector<ll::LLStatic>& ss, const std::vector<Call>& cs, Kernel kernel, int smem) {
    std::vector<std::unique_ptr<SimBlock>> blocks;
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ss.size(); ++i) {
        for (int b = 0; b < ss[i].num_blocks; ++b) {
            blocks.push_back(std::make_unique<SimBlock>(ll::kThreadsPerBlock, (size_t)smem));
            SimBlock* blk = blocks.back().get();
            for (int t = 0; t < ll::kThreadsPerBlock; ++t) {
                const ll::LLStatic s = ss[i];
                const Call c = cs[i];
                threads.emplace_back([=] {
                    SimThread st{{(unsigned)t}, {(unsigned)b}, {(unsigned)ll::kThreadsPerBlock},
                                 {(unsigned)s.num_blocks}, blk};
                    g_sim = &st;
                    kernel(s, c);
                });
            }
        }
    }
    for (auto& th : threads) th.join();
}

// The in-process NIC: a full mesh of RC QPs (num_qps per ordered pair), executed by one thread.
class SimNic {
  public:
    SimNic(std::vector<uint64_t> bufs, std::vector<uint64_t> sizes, int nqp, int log_sq)
        : bufs_(std::move(bufs)), sizes_(std::move(sizes)), nqp_(nqp), log_sq_(log_sq) {
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
            const uint64_t mask = (1ull << log_sq_) - 1;
            for (uint16_t i = 0; i < delta; ++i) execute(q, gda::decode_wqe(q.sq + ((q.pi + i) & mask) * 64));
            q.pi += delta;
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
    std::vector<gda::Qp*> ctx_;
    std::vector<Q> queues_;
    std::vector<void*> mem_;
    std::atomic<bool> running_{true};
    std::atomic<uint64_t> executed_{0};
    std::mutex err_m_;
    std::vector<std::string> errors_;
    std::thread thread_;
};

}  // namespace

PYBIND11_MODULE(ll_sim, m) {
    m.attr("threads_per_block") = ll::kThreadsPerBlock;
    m.def("dispatch", [](const py::list& statics, const py::list& calls) {
        std::vector<ll::LLStatic> ss;
        std::vector<ll::LLDispatchCall> cs;
        for (size_t i = 0; i < statics.size(); ++i) {
            ss.push_back(static_from(statics[i].cast<py::dict>()));
            cs.push_back(dispatch_from(calls[i].cast<py::dict>()));
            ll::check_call(ss.back(), cs.back());   // what launch_dispatch checks first
        }
        const int smem = ll::dispatch_smem_bytes(ss.at(0));
        const bool fp8 = cs.at(0).use_fp8 != 0;
        py::gil_scoped_release nogil;
        if (fp8) run_grids(ss, cs, ll::dispatch<true>, smem);
        else run_grids(ss, cs, ll::dispatch<false>, smem);
    });
    m.def("combine", [](const py::list& statics, const py::list& calls) {
        std::vector<ll::LLStatic> ss;
        std::vector<ll::LLCombineCall> cs;
        for (size_t i = 0; i < statics.size(); ++i) {
            ss.push_back(static_from(statics[i].cast<py::dict>()));
            cs.push_back(combine_from(calls[i].cast<py::dict>()));
            ll::check_call(ss.back(), cs.back());
        }
        const int smem = ll::combine_smem_bytes(ss.at(0));
        py::gil_scoped_release nogil;
        run_grids(ss, cs, ll::combine, smem);
    });
    py::class_<SimNic>(m, "SimNic")
        .def(py::init<std::vector<uint64_t>, std::vector<uint64_t>, int, int>())
        .def("contexts", &SimNic::contexts)
        .def("errors", &SimNic::errors)
        .def("executed", &SimNic::executed);
}
