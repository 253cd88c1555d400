// pyep._engine.HostQp: a gda::Qp device context in host memory, driven by CPU threads through the very
// qp.h functions GPU kernels use (tests, tools, the softnic selftest). Posting calls release the GIL,
// so many Python threads can post to one QP concurrently (qp.h's lock-free reservation).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "bindings/registry.h"
#include "mlx5gda/provider.h"
#include "mlx5gda/qp.h"

namespace py = pybind11;

namespace pyep {
namespace bindings {
namespace {

uint64_t to_ns(double timeout_s) {
    if (!(timeout_s > 0) || timeout_s > 3600)
        throw py::value_error("timeout_s must be in (0, 3600] seconds, got " + std::to_string(timeout_s));
    return (uint64_t)(timeout_s * 1e9);
}

uint8_t opcode_from(const py::handle& h) {
    if (py::isinstance<py::str>(h)) {
        const std::string s = h.cast<std::string>();
        if (s == "nop") return prm::kOpNop;
        if (s == "rdma_write") return prm::kOpRdmaWrite;
        if (s == "masked_fa32") return prm::kOpAtomicMaskedFa;
        if (s == "fa64") return prm::kOpAtomicFa;
        throw py::value_error("unknown opcode '" + s + "' (nop, rdma_write, masked_fa32, fa64)");
    }
    const int v = h.cast<int>();
    if (gda::wqe_ds((uint8_t)v) == 0 || v < 0 || v > 255)
        throw py::value_error("opcode " + std::to_string(v) + " is not one pyep posts");
    return (uint8_t)v;
}

class HostQp {
  public:
    HostQp(uint32_t qpn, uint32_t log_sq, uint64_t sq, uint64_t dbrec, uint64_t bf, uint32_t bf_size, uint64_t cqes,
           uint64_t cq_dbrec, uint32_t cq_log_size, int64_t cq_ci) {
        if (!sq || !dbrec || !bf || !cqes || !cq_dbrec) throw py::value_error("HostQp: ring/CQ/doorbell addresses must be non-zero");
        if (log_sq < 1 || log_sq > 15 || cq_log_size < 1 || cq_log_size > 22)
            throw py::value_error("HostQp: log_sq must be 1..15 and cq_log_size 1..22");
        if (qpn == 0 || qpn > 0xffffff) throw py::value_error("HostQp: qpn must be a 24-bit non-zero number");
        if (cq_ci > (int64_t)prm::kCqCiMask) throw py::value_error("HostQp: cq_ci is a 24-bit consumer index");
        nic::QpInfo qi;
        qi.qpn = qpn;
        qi.log_sq = log_sq;
        qi.sq = reinterpret_cast<uint8_t*>(sq);
        qi.dbrec = reinterpret_cast<uint32_t*>(dbrec);
        qi.bf = reinterpret_cast<uint8_t*>(bf);
        qi.bf_size = bf_size;
        nic::CqInfo ci;
        ci.cqes = reinterpret_cast<prm::Cqe64*>(cqes);
        ci.dbrec = reinterpret_cast<uint32_t*>(cq_dbrec);
        ci.log_size = cq_log_size;
        void* p = nullptr;
        if (posix_memalign(&p, 64, sizeof(gda::Qp)) != 0) throw std::bad_alloc();
        ctx_ = static_cast<gda::Qp*>(p);
        *ctx_ = nic::make_qp_context(qi, ci);
        // The CQ may have been used before (a QP reset and reconnected, its CQEs cleaned by the
        // provider): a new poller continues at the consumer index the CQ doorbell record holds.
        if (cq_ci < 0)
            cq_ci = gda::be32toh_(__atomic_load_n(&ci.dbrec[prm::kCqDbrSetCi], __ATOMIC_ACQUIRE)) & prm::kCqCiMask;
        ctx_->cq.ci = (uint64_t)cq_ci;
    }
    ~HostQp() { free(ctx_); }
    HostQp(const HostQp&) = delete;
    HostQp& operator=(const HostQp&) = delete;

    gda::Qp* ctx() { return ctx_; }

    // Posts raw WQEBBs (any bytes: malformed WQEs for tests) through the normal reservation and
    // doorbell path. fix_index / fix_qpn patch ctrl.wqe_index / ctrl.qpn to the right values first.
    int post_raw(const std::string& bytes, bool fix_index, bool fix_qpn, uint64_t timeout_ns) {
        if (bytes.empty() || bytes.size() % prm::kSendWqeBB) throw py::value_error("post_raw: need a multiple of 64 bytes");
        const uint32_t n = (uint32_t)(bytes.size() / prm::kSendWqeBB);
        uint64_t start = 0;
        int st;
        {
            py::gil_scoped_release r;
            st = gda::reserve_wqebbs(ctx_, n, timeout_ns, &start);
        }
        if (st != gda::kOk) return st;
        std::string w = bytes;
        uint32_t oio, qds;
        std::memcpy(&oio, w.data(), 4);
        std::memcpy(&qds, w.data() + 4, 4);
        oio = gda::be32toh_(oio);
        qds = gda::be32toh_(qds);
        if (fix_index) oio = (oio & 0xff0000ffu) | ((uint32_t)(uint16_t)start << 8);
        if (fix_qpn) qds = (ctx_->qpn << 8) | (qds & 0xff);
        oio = gda::htobe32_(oio);
        qds = gda::htobe32_(qds);
        std::memcpy(&w[0], &oio, 4);
        std::memcpy(&w[4], &qds, 4);
        const bool signaled = ((uint8_t)w[11] & prm::kCtrlCqUpdate) != 0;
        const uint32_t mask = gda::sq_size(ctx_) - 1;
        for (uint32_t i = 0; i < n; ++i)
            std::memcpy(ctx_->sq + ((start + i) & mask) * prm::kSendWqeBB, w.data() + i * prm::kSendWqeBB, prm::kSendWqeBB);
        py::gil_scoped_release r;
        return gda::ring_doorbell(ctx_, start, n, signaled, timeout_ns);
    }

  private:
    gda::Qp* ctx_ = nullptr;
};

void register_gda_host(py::module_& m) {
    using R = py::call_guard<py::gil_scoped_release>;
    py::class_<HostQp>(m, "HostQp", "A QP device context in host memory, posted to by CPU threads via qp.h")
        .def(py::init<uint32_t, uint32_t, uint64_t, uint64_t, uint64_t, uint32_t, uint64_t, uint64_t, uint32_t, int64_t>(),
             py::arg("qpn"), py::arg("log_sq"), py::arg("sq"), py::arg("dbrec"), py::arg("bf"), py::arg("bf_size"),
             py::arg("cqes"), py::arg("cq_dbrec"), py::arg("cq_log_size"), py::arg("cq_ci") = -1,
             "cq_ci: the CQ consumer index to start at; -1 reads it from the CQ doorbell record")
        .def("post_rdma_write", [](HostQp& q, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint32_t length,
                                   bool signaled, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::post_rdma_write(q.ctx(), laddr, lkey, raddr, rkey, length, signaled, t);
        }, py::arg("laddr"), py::arg("lkey"), py::arg("raddr"), py::arg("rkey"), py::arg("length"),
           py::arg("signaled") = false, py::arg("timeout_s") = 5.0)
        .def("post_masked_fa32", [](HostQp& q, uint64_t raddr, uint32_t rkey, uint32_t add, uint64_t fetch_laddr,
                                    uint32_t fetch_lkey, bool signaled, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::post_masked_fa32(q.ctx(), raddr, rkey, add, fetch_laddr, fetch_lkey, signaled, t);
        }, py::arg("raddr"), py::arg("rkey"), py::arg("add"), py::arg("fetch_laddr"), py::arg("fetch_lkey"),
           py::arg("signaled") = false, py::arg("timeout_s") = 5.0)
        .def("post_fa64", [](HostQp& q, uint64_t raddr, uint32_t rkey, uint64_t add, uint64_t fetch_laddr,
                             uint32_t fetch_lkey, bool signaled, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::post_fa64(q.ctx(), raddr, rkey, add, fetch_laddr, fetch_lkey, signaled, t);
        }, py::arg("raddr"), py::arg("rkey"), py::arg("add"), py::arg("fetch_laddr"), py::arg("fetch_lkey"),
           py::arg("signaled") = false, py::arg("timeout_s") = 5.0)
        .def("post_nop", [](HostQp& q, bool signaled, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::post_nop(q.ctx(), signaled, t);
        }, py::arg("signaled") = false, py::arg("timeout_s") = 5.0)
        .def("post_write_with_signal", [](HostQp& q, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                          uint32_t length, uint64_t sig_raddr, uint32_t sig_rkey, uint32_t add,
                                          uint64_t fetch_laddr, uint32_t fetch_lkey, bool signaled, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::post_write_with_signal(q.ctx(), laddr, lkey, raddr, rkey, length, sig_raddr, sig_rkey, add,
                                               fetch_laddr, fetch_lkey, signaled, t);
        }, py::arg("laddr"), py::arg("lkey"), py::arg("raddr"), py::arg("rkey"), py::arg("length"), py::arg("sig_raddr"),
           py::arg("sig_rkey"), py::arg("add"), py::arg("fetch_laddr"), py::arg("fetch_lkey"),
           py::arg("signaled") = false, py::arg("timeout_s") = 5.0)
        .def("post_batch", [](HostQp& q, const py::list& wrs, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            std::vector<gda::WorkRequest> v;
            for (py::handle h : wrs) {
                const py::dict d = h.cast<py::dict>();
                gda::WorkRequest wr;
                for (auto item : d) {
                    const std::string k = item.first.cast<std::string>();
                    if (k == "opcode") wr.opcode = opcode_from(item.second);
                    else if (k == "signaled") wr.signaled = item.second.cast<bool>();
                    else if (k == "fence") wr.fence = item.second.cast<bool>();
                    else if (k == "laddr") wr.laddr = item.second.cast<uint64_t>();
                    else if (k == "lkey") wr.lkey = item.second.cast<uint32_t>();
                    else if (k == "raddr") wr.raddr = item.second.cast<uint64_t>();
                    else if (k == "rkey") wr.rkey = item.second.cast<uint32_t>();
                    else if (k == "length") wr.length = item.second.cast<uint32_t>();
                    else if (k == "add") wr.add = item.second.cast<uint64_t>();
                    else throw py::value_error("post_batch: unknown work request field '" + k + "'");
                }
                if (!d.contains("opcode")) throw py::value_error("post_batch: every work request needs an 'opcode'");
                v.push_back(wr);
            }
            if (v.empty()) throw py::value_error("post_batch: empty batch");
            py::gil_scoped_release r;
            return gda::post_batch(q.ctx(), v.data(), (uint32_t)v.size(), t);
        }, py::arg("wrs"), py::arg("timeout_s") = 5.0)
        .def("post_raw", [](HostQp& q, const py::bytes& wqebbs, bool fix_index, bool fix_qpn, double timeout_s) {
            return q.post_raw(std::string(wqebbs), fix_index, fix_qpn, to_ns(timeout_s));
        }, py::arg("wqebbs"), py::arg("fix_index") = true, py::arg("fix_qpn") = true, py::arg("timeout_s") = 5.0)
        .def("quiet", [](HostQp& q, double timeout_s) {
            const uint64_t t = to_ns(timeout_s);
            py::gil_scoped_release r;
            return gda::quiet(q.ctx(), t);
        }, py::arg("timeout_s") = 5.0)
        .def("poll", [](HostQp& q) { return gda::poll_send_cq(q.ctx()); }, R())
        .def("error", [](HostQp& q) {
            const gda::QpError e = q.ctx()->err;
            py::dict d;
            d["valid"] = gda::qp_in_error(q.ctx());
            d["kind"] = e.kind;
            d["cqe_opcode"] = e.cqe_opcode;
            d["syndrome"] = e.syndrome;
            d["vendor_syndrome"] = e.vendor_syndrome;
            d["wqe_opcode"] = e.wqe_opcode;
            d["wqe_counter"] = e.wqe_counter;
            d["when_ns"] = e.when_ns;
            return d;
        })
        .def("counters", [](HostQp& q) {
            const gda::Qp* c = q.ctx();
            py::dict d;
            d["resv"] = gda::load_acquire_u64(&c->resv);
            d["ready"] = gda::load_acquire_u64(&c->ready);
            d["cons"] = gda::load_acquire_u64(&c->cons);
            d["signaled"] = gda::load_acquire_u64(&c->signaled);
            d["wqes_posted"] = gda::load_acquire_u64(&c->wqes_posted);
            d["bytes_posted"] = gda::load_acquire_u64(&c->bytes_posted);
            d["cq_ci"] = gda::load_acquire_u64(&c->cq.ci);
            return d;
        })
        .def_property_readonly("qpn", [](HostQp& q) { return q.ctx()->qpn; })
        .def_property_readonly("log_sq", [](HostQp& q) { return q.ctx()->log_sq; })
        .def_property_readonly("sq", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx()->sq; })
        .def_property_readonly("dbrec", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx()->dbrec; })
        .def_property_readonly("bf", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx()->bf; })
        .def_property_readonly("cqes", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx()->cq.cqes; })
        .def_property_readonly("cq_dbrec", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx()->cq.dbrec; })
        .def_property_readonly("context_address", [](HostQp& q) { return (uint64_t)(uintptr_t)q.ctx(); })
        .def("context_bytes", [](HostQp& q) {
            return py::bytes(reinterpret_cast<const char*>(q.ctx()), sizeof(gda::Qp));
        }, "The gda::Qp bytes, to copy into GPU memory for a GPU poster (a fresh context: copy before posting)")
        .def_property_readonly_static("context_size", [](py::object) { return sizeof(gda::Qp); });
    py::dict status;
    status["ok"] = (int)gda::kOk;
    status["err_qp"] = (int)gda::kErrQp;
    status["err_timeout"] = (int)gda::kErrTimeout;
    status["err_invalid"] = (int)gda::kErrInvalid;
    m.attr("gda_status") = status;
}

const Registrar registrar("gda_host", &register_gda_host);

}  // namespace
}  // namespace bindings
}  // namespace pyep
