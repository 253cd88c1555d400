// DevxProvider implementation. Sequence (REFERENCE.md §3): open with DevX -> PD + pdn -> port/GID ->
// QUERY_HCA_CAP -> per CQ/QP: control memory as UMEM, UAR, CREATE_CQ/CREATE_QP -> RST2INIT -> INIT2RTR
// -> RTR2RTS. Opening and discovery live in devx_open.cpp, control-memory placement and the GPU's
// UAR mapping in devx_mem.cpp.
#if defined(PYEP_HAVE_RDMA_CORE)

#include "mlx5gda/devx_provider.h"

#include <cerrno>
#include <cstring>

#include "mlx5gda/devx_impl.h"

namespace pyep {
namespace nic {

void DevxProvider::Impl::teardown() {
    for (auto& [qpn, qp] : qps) {
        if (qp.obj) lib.obj_destroy(qp.obj);
        placer->free_uar(qp.uar);
        placer->free(qp.mem);
    }
    qps.clear();
    for (auto& [cqn, cq] : cqs) {
        if (cq.obj) lib.obj_destroy(cq.obj);
        placer->free(cq.mem);
    }
    cqs.clear();
    for (auto& [lkey, mr] : mrs) lib.dereg_mr(mr);
    mrs.clear();
}

DevxProvider::DevxProvider(const DevxOptions& opts, LogFn log) : impl_(std::make_unique<Impl>()) {
    if (opts.device_name.empty()) throw ProviderError("DevxProvider needs a device name (e.g. mlx5_0)");
    impl_->opts = opts;
    impl_->log = std::move(log);
    try {
        impl_->open();
    } catch (...) {
        if (impl_->cq_uar) impl_->lib.free_uar(impl_->cq_uar);
        if (impl_->pd) impl_->lib.dealloc_pd(impl_->pd);
        if (impl_->ctx) impl_->lib.close_device(impl_->ctx);
        throw;
    }
}

DevxProvider::~DevxProvider() {
    Impl& d = *impl_;
    if (d.placer) d.teardown();
    d.placer.reset();
    if (d.cq_uar) d.lib.free_uar(d.cq_uar);
    if (d.pd) d.lib.dealloc_pd(d.pd);
    if (d.ctx) d.lib.close_device(d.ctx);
}

Caps DevxProvider::query_caps() {
    Impl& d = *impl_;
    Caps c;
    c.device_name = d.opts.device_name;
    c.max_qp_wr_log = d.caps.log_max_qp_sz;
    c.max_cqe_log = d.caps.log_max_cq_sz;
    c.log_max_msg = d.caps.log_max_msg;
    c.cqe_version = d.caps.cqe_version;
    c.atomic_fa64 = d.caps.fetch_add_64;
    c.atomic_masked_fa32 = d.caps.masked_fetch_add_32;
    c.ib = !d.roce();
    return c;
}

Address DevxProvider::local_address() {
    Impl& d = *impl_;
    Address a;
    a.lid = d.port.lid;
    memcpy(a.gid, d.gid, 16);
    memcpy(a.mac, d.mac, 6);
    a.port = d.opts.port;
    a.gid_index = (uint8_t)d.gid_index;
    return a;
}

CqInfo DevxProvider::create_cq(uint32_t log_size, Placement placement) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    if (log_size > d.caps.log_max_cq_sz) {
        throw ProviderError("CQ of 2^" + std::to_string(log_size) + " entries exceeds the device limit 2^" +
                            std::to_string(d.caps.log_max_cq_sz));
    }
    const size_t ring = (size_t)prm::kCqeBytes << log_size;
    Impl::Cq cq;
    cq.log_size = log_size;
    cq.mem = d.placer->alloc(ring, placement, "cq");
    d.placer->init_cqes(cq.mem, 1u << log_size);
    devx::CreateCqParams p;
    p.log_cq_size = log_size;
    p.uar_page = d.cq_uar->page_id;
    p.eqn = d.eqn;
    p.cq_umem_id = cq.mem.umem->umem_id;
    p.cq_umem_offset = 0;
    p.dbr_umem_id = cq.mem.umem->umem_id;
    p.dbr_offset = cq.mem.dbr_offset;
    const devx::Bytes in = devx::encode_create_cq(p);
    devx::Bytes out(devx::kCmdOutHdrBytes, 0);
    cq.obj = d.lib.obj_create(d.ctx, in.data(), in.size(), out.data(), out.size());
    if (!cq.obj) {
        const std::string msg = cmd_error("CREATE_CQ", 0, out);
        d.placer->free(cq.mem);
        throw ProviderError(msg + " on " + d.opts.device_name);
    }
    const uint32_t cqn = devx::parse_created_id(out.data(), out.size());
    CqInfo info;
    info.cqn = cqn;
    info.log_size = log_size;
    info.cqes = reinterpret_cast<prm::Cqe64*>(cq.mem.poster);
    info.dbrec = reinterpret_cast<uint32_t*>(cq.mem.poster + cq.mem.dbr_offset);
    d.say(10, "created CQ " + std::to_string(cqn) + " (2^" + std::to_string(log_size) + " CQEs, " + cq.mem.where + ")");
    d.cqs[cqn] = std::move(cq);
    return info;
}

QpInfo DevxProvider::create_qp(const CqInfo& cqi, uint32_t log_sq, Placement placement) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    if (!d.cqs.count(cqi.cqn)) throw ProviderError("create_qp: no CQ " + std::to_string(cqi.cqn) + " on this provider");
    if (log_sq > d.caps.log_max_qp_sz) {
        throw ProviderError("SQ of 2^" + std::to_string(log_sq) + " WQEBBs exceeds the device limit 2^" +
                            std::to_string(d.caps.log_max_qp_sz));
    }
    Impl::Qp qp;
    qp.cqn = cqi.cqn;
    qp.mem = d.placer->alloc((size_t)prm::kSendWqeBB << log_sq, placement, "qp");
    try {
        qp.uar = d.placer->alloc_uar(placement != Placement::Host);
    } catch (...) {
        d.placer->free(qp.mem);
        throw;
    }
    devx::CreateQpParams p;
    p.pd = d.pdn;
    p.uar_page = qp.uar.uar->page_id;
    p.cqn_snd = p.cqn_rcv = cqi.cqn;
    p.log_sq_size = log_sq;
    p.log_msg_max = d.caps.log_max_msg;
    p.wq_umem_id = p.dbr_umem_id = qp.mem.umem->umem_id;
    p.wq_umem_offset = 0;
    p.dbr_offset = qp.mem.dbr_offset;
    p.ts_format = d.caps.sq_ts_format ? devx::kTsDefault : devx::kTsFreeRunning;
    const devx::Bytes in = devx::encode_create_qp(p);
    devx::Bytes out(devx::kCmdOutHdrBytes, 0);
    qp.obj = d.lib.obj_create(d.ctx, in.data(), in.size(), out.data(), out.size());
    if (!qp.obj) {
        const std::string msg = cmd_error("CREATE_QP", 0, out);
        d.placer->free_uar(qp.uar);
        d.placer->free(qp.mem);
        throw ProviderError(msg + " on " + d.opts.device_name);
    }
    QpInfo info;
    info.qpn = devx::parse_created_id(out.data(), out.size());
    info.log_sq = log_sq;
    info.sq = qp.mem.poster;
    info.dbrec = reinterpret_cast<uint32_t*>(qp.mem.poster + qp.mem.dbr_offset);
    info.bf = qp.uar.poster_reg;
    info.bf_size = d.caps.log_bf_reg_size ? (1u << d.caps.log_bf_reg_size) / 2 : 256;
    info.cqn = cqi.cqn;
    d.say(10, "created QP " + std::to_string(info.qpn) + " (2^" + std::to_string(log_sq) + " WQEBBs, " + qp.mem.where + ")");
    d.qps[info.qpn] = std::move(qp);
    return info;
}

void DevxProvider::modify_qp_rst2init(uint32_t qpn, uint32_t access) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    devx::Rst2InitParams p;
    p.qpn = qpn;
    p.port = d.opts.port;
    p.remote_read = access & prm::kAccessRemoteRead;
    p.remote_write = access & prm::kAccessRemoteWrite;
    p.remote_atomic = access & prm::kAccessRemoteAtomic;
    p.atomic_mode = p.remote_atomic ? devx::atomic_mode_for((uint16_t)d.caps.atomic_size_qp) : 0;
    d.modify(qpn, devx::encode_rst2init(p), "RST2INIT_QP");
}

static uint32_t log2_floor(uint32_t v) {
    uint32_t l = 0;
    while (v > 1) v >>= 1, ++l;
    return l;
}

void DevxProvider::modify_qp_init2rtr(uint32_t qpn, const ConnectAttr& a) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    devx::Init2RtrParams p;
    p.qpn = qpn;
    const uint32_t port_mtu = 128u << d.port.active_mtu;
    p.mtu = a.mtu < port_mtu ? a.mtu : port_mtu;
    p.log_msg_max = d.caps.log_max_msg;
    p.remote_qpn = a.remote_qpn;
    p.next_rcv_psn = a.rq_psn;
    p.min_rnr_nak = a.min_rnr_timer;
    const uint32_t rra = log2_floor(a.max_rd_atomic ? a.max_rd_atomic : 1);
    p.log_rra_max = rra < d.caps.log_max_ra_res_qp ? rra : d.caps.log_max_ra_res_qp;
    p.port = d.opts.port;
    p.roce = d.roce();
    p.sl = a.sl;
    p.traffic_class = a.traffic_class;
    p.src_addr_index = (uint32_t)d.gid_index;
    memcpy(p.rgid, a.remote.gid, 16);
    if (p.roce) {
        p.hop_limit = 64;
        p.udp_sport = a.udp_sport ? a.udp_sport
                                  : d.opts.udp_sport_base +
                                        ((qpn * 2654435761u) ^ a.remote_qpn) % (0x10000u - d.opts.udp_sport_base);
        memcpy(p.rmac, a.remote.mac, 6);
        // The next-hop MAC is the kernel's business (neighbour table, routing): an address handle
        // resolves it, which is right for routed RoCE too. The peer's own MAC is the fallback.
        ibv_ah_attr ah{};
        ah.is_global = 1;
        memcpy(ah.grh.dgid.raw, a.remote.gid, 16);
        ah.grh.sgid_index = (uint8_t)d.gid_index;
        ah.grh.hop_limit = 64;
        ah.grh.traffic_class = a.traffic_class;
        ah.port_num = d.opts.port;
        if (ibv_ah* h = d.lib.create_ah(d.pd, &ah)) {
            mlx5dv_ah dvah{};
            mlx5dv_obj o{};
            o.ah.in = h;
            o.ah.out = &dvah;
            if (!d.lib.init_obj(&o, MLX5DV_OBJ_AH) && dvah.av) memcpy(p.rmac, dvah.av->rmac, 6);
            d.lib.destroy_ah(h);
        } else {
            d.say(30, "ibv_create_ah for the remote GID failed (" + errstr(errno) +
                          "); using the MAC the peer reported, which is right only on one L2 segment");
        }
    } else {
        p.rlid = a.remote.lid;
        p.grh = false;
    }
    d.modify(qpn, devx::encode_init2rtr(p), "INIT2RTR_QP");
}

void DevxProvider::modify_qp_rtr2rts(uint32_t qpn, const ConnectAttr& a) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    devx::Rtr2RtsParams p;
    p.qpn = qpn;
    p.retry_count = a.retry_cnt;
    p.rnr_retry = a.rnr_retry;
    p.ack_timeout = a.ack_timeout;
    p.next_send_psn = a.sq_psn;
    const uint32_t sra = log2_floor(a.max_rd_atomic ? a.max_rd_atomic : 1);
    p.log_sra_max = sra < d.caps.log_max_ra_req_qp ? sra : d.caps.log_max_ra_req_qp;
    d.modify(qpn, devx::encode_rtr2rts(p), "RTR2RTS_QP");
}

void DevxProvider::modify_qp_to_reset(uint32_t qpn) {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->modify(qpn, devx::encode_qp_2rst(qpn), "2RST_QP");
}

void DevxProvider::modify_qp_to_error(uint32_t qpn) {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->modify(qpn, devx::encode_qp_2err(qpn), "2ERR_QP");
}

uint8_t DevxProvider::query_qp_state(uint32_t qpn) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    Impl::Qp& qp = d.qp_or_throw(qpn);
    const devx::Bytes in = devx::encode_query_qp(qpn);
    devx::Bytes out(devx::kQueryQpOutBytes, 0);
    const int ret = d.lib.obj_query(qp.obj, in.data(), in.size(), out.data(), out.size());
    if (ret) throw ProviderError(cmd_error("QUERY_QP", ret, out) + " on QP " + std::to_string(qpn));
    return devx::parse_query_qp_state(out.data(), out.size());
}

void DevxProvider::destroy_qp(uint32_t qpn) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    Impl::Qp& qp = d.qp_or_throw(qpn);
    if (int ret = d.lib.obj_destroy(qp.obj)) throw ProviderError("destroying QP " + std::to_string(qpn) + ": " + errstr(ret));
    d.placer->free_uar(qp.uar);
    d.placer->free(qp.mem);
    d.qps.erase(qpn);
}

void DevxProvider::destroy_cq(uint32_t cqn) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    auto it = d.cqs.find(cqn);
    if (it == d.cqs.end()) throw ProviderError("no CQ " + std::to_string(cqn) + " on " + d.opts.device_name);
    for (auto& [qpn, qp] : d.qps) {
        if (qp.cqn == cqn) {
            throw ProviderError("CQ " + std::to_string(cqn) + " still serves QP " + std::to_string(qpn) +
                                ": destroy the QP first");
        }
    }
    if (int ret = d.lib.obj_destroy(it->second.obj)) {
        throw ProviderError("destroying CQ " + std::to_string(cqn) + ": " + errstr(ret));
    }
    d.placer->free(it->second.mem);
    d.cqs.erase(it);
}

MrInfo DevxProvider::reg_mr(void* addr, uint64_t length, uint32_t access) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    if (!addr || !length) throw ProviderError("reg_mr: empty region");
    ibv_mr* mr = d.placer->reg_mr(addr, length, access);
    d.mrs[mr->lkey] = mr;
    MrInfo m;
    m.addr = reinterpret_cast<uint64_t>(addr);
    m.length = length;
    m.lkey = mr->lkey;
    m.rkey = mr->rkey;
    m.access = access;
    return m;
}

void DevxProvider::dereg_mr(uint32_t lkey) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lk(d.mu);
    auto it = d.mrs.find(lkey);
    if (it == d.mrs.end()) throw ProviderError("no MR with lkey " + std::to_string(lkey));
    if (int ret = d.lib.dereg_mr(it->second)) throw ProviderError("ibv_dereg_mr: " + errstr(ret));
    d.mrs.erase(it);
}

const devx::HcaCaps& DevxProvider::hca_caps() const { return impl_->caps; }
uint32_t DevxProvider::pdn() const { return impl_->pdn; }
uint32_t DevxProvider::active_mtu() const { return 128u << impl_->port.active_mtu; }
bool DevxProvider::link_is_ib() const { return !impl_->roce(); }

std::vector<std::pair<std::string, std::string>> DevxProvider::placements() const {
    std::vector<std::pair<std::string, std::string>> v;
    for (auto& [n, cq] : impl_->cqs) v.emplace_back("cq " + std::to_string(n), cq.mem.where);
    for (auto& [n, qp] : impl_->qps) v.emplace_back("qp " + std::to_string(n), qp.mem.where);
    return v;
}

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
