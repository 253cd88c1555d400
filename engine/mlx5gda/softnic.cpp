// The softnic's control plane, part 1: construction, CQs, QPs and the QP state machine.
// Part 2 (memory, progress control, faults, diagnostics) is softnic_admin.cpp; the data path is
// softnic_engine.cpp / softnic_exec.cpp.
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <sstream>

#include "mlx5gda/softnic_internal.h"

namespace pyep {

#if !defined(PYEP_WITH_CUDA)
namespace softnic {
std::unique_ptr<CudaBackend> make_cuda_backend() { return nullptr; }
}  // namespace softnic
#endif

namespace nic {

using namespace softnic;
using Impl = SoftNicProvider::Impl;

namespace {

void require_state(const QpObj& q, uint8_t want, const char* transition) {
    if (q.state != want)
        throw ProviderError(std::string(transition) + " on QP " + hex(q.qpn) + ": the QP is in " +
                            state_name(q.state) + ", the transition needs " + state_name(want));
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Impl helpers

QpObj& Impl::qp(uint32_t qpn) {
    auto it = qps.find(qpn);
    if (it == qps.end()) throw ProviderError("softnic: no QP " + hex(qpn) + " on node " + std::to_string(node_id));
    return *it->second;
}

CqObj& Impl::cq(uint32_t cqn) {
    auto it = cqs.find(cqn);
    if (it == cqs.end()) throw ProviderError("softnic: no CQ " + std::to_string(cqn));
    return *it->second;
}

void Impl::publish_qp(const QpObj& q) {
    QpEntry e{};
    e.qpn = q.qpn;
    e.state = q.state;
    e.access = q.access;
    e.remote_qpn = q.remote_qpn;
    e.remote_node = q.remote_node;
    seq_publish(&qp_entries(hdr)[q.slot], &e, sizeof(e));
}

void Impl::publish_mr(uint32_t slot) {
    MrEntry e{};
    if (const MrObj* mr = mrs[slot].get()) {
        e.key = mr->info.lkey;
        e.valid = mr->valid ? 1 : 0;
        e.access = mr->info.access;
        e.kind = (uint32_t)mr->kind;
        e.addr = mr->info.addr;
        e.length = mr->info.length;
        e.seg_index = mr->seg_index;
        e.device = mr->device;
        e.seg_offset = mr->seg_offset;
        std::memcpy(e.ipc, mr->ipc, sizeof(e.ipc));
    }
    seq_publish(&mr_entries(hdr)[slot], &e, sizeof(e));
}

void Impl::set_state(QpObj& q, uint8_t state) {
    q.state = state;
    publish_qp(q);
}

void Impl::event(const std::string& text) {
    if (events.size() >= kMaxEvents) events.pop_front();
    events.push_back(text);
}

Allocation Impl::alloc_control(size_t bytes, Placement placement, const char* what) {
    if (placement == Placement::Device)
        throw ProviderError(std::string("softnic: ") + what + " in device memory is not supported: the "
                            "softnic polls doorbells and writes CQEs from the host; use HostMapped");
    Allocation a;
    a.bytes = bytes;
    if (placement == Placement::HostMapped && cuda) {
        void* dev = nullptr;
        a.host = static_cast<uint8_t*>(cuda->alloc_host_mapped(bytes, &dev));
        if (!a.host) throw ProviderError(std::string("softnic: host-mapped ") + what + ": " + cuda->last_error());
        a.dev = static_cast<uint8_t*>(dev);
        a.cuda_mapped = true;
    } else {
        // Host, or HostMapped in a build/machine without CUDA (the two are the same memory then).
        void* p = nullptr;
        if (posix_memalign(&p, 4096, bytes) != 0) throw ProviderError(std::string("softnic: out of memory for ") + what);
        a.host = a.dev = static_cast<uint8_t*>(p);
    }
    std::memset(a.host, 0, bytes);
    return a;
}

void Impl::free_control(Allocation& a) {
    if (!a.host) return;
    if (a.cuda_mapped) cuda->free_host_mapped(a.host);
    else free(a.host);
    a = Allocation{};
}

void Impl::clean_cq(const QpObj& q) {
    // What libmlx5 does on a transition to RESET (and on destroy): CQEs of this QP the poller has not
    // consumed yet are removed, later ones of other QPs are moved down over them, and the consumer
    // index advances past the freed slots. A poller context built afterwards starts at that set_ci.
    auto it = cqs.find(q.cqn);
    if (it == cqs.end()) return;
    CqObj& c = *it->second;
    auto* dbr = reinterpret_cast<uint32_t*>(c.dbr.host);
    const uint32_t set_ci = gda::be32toh_(__atomic_load_n(&dbr[prm::kCqDbrSetCi], __ATOMIC_ACQUIRE)) & prm::kCqCiMask;
    const uint64_t outstanding = ((uint32_t)c.pi - set_ci) & prm::kCqCiMask;
    const uint32_t size = 1u << c.log_size;
    if (outstanding > size) return;  // an overrun CQ is beyond repair; it stays in error
    const uint64_t ci = c.pi - outstanding;
    auto* ring = reinterpret_cast<prm::Cqe64*>(c.ring.host);
    uint64_t freed = 0;
    for (uint64_t idx = c.pi; idx-- > ci;) {
        prm::Cqe64* cqe = &ring[idx & (size - 1)];
        if ((gda::be32toh_(cqe->sop_drop_qpn) & 0xffffff) == q.qpn) {
            ++freed;
        } else if (freed) {
            prm::Cqe64* dest = &ring[(idx + freed) & (size - 1)];
            const uint8_t owner = dest->op_own & prm::kCqeOwnerMask;
            std::memcpy(dest, cqe, sizeof(*dest) - 1);
            __atomic_store_n(&dest->op_own, (uint8_t)((cqe->op_own & ~prm::kCqeOwnerMask) | owner), __ATOMIC_RELEASE);
        }
    }
    if (freed)
        __atomic_store_n(&dbr[prm::kCqDbrSetCi], gda::htobe32_((uint32_t)((ci + freed) & prm::kCqCiMask)), __ATOMIC_RELEASE);
}

void Impl::release_qp_cuda(QpObj& q) {
    if (!cuda) return;
    if (q.stream) {
        if (!cuda->sync_stream(q.stream, 5000000000ull))
            event("QP " + hex(q.qpn) + ": CUDA stream did not drain within 5 s while releasing: " + cuda->last_error());
        for (auto& c : q.pending)
            if (c.event) cuda->destroy_event(c.event);
        cuda->destroy_stream(q.stream);
        q.stream = nullptr;
    }
    if (q.scratch) {
        cuda->free_host_mapped(q.scratch);
        q.scratch = q.scratch_dev = nullptr;
    }
}

// ---------------------------------------------------------------------------------------------------
// Construction

SoftNicProvider::SoftNicProvider(const Options& options) : impl_(new Impl) {
    Impl& m = *impl_;
    m.opt = options;
    if (options.max_mrs == 0 || options.max_mrs > (1u << 16))
        throw ProviderError("softnic: max_mrs must be in 1..65536, got " + std::to_string(options.max_mrs));
    if (options.max_qps == 0 || options.max_qps > (1u << 16))
        throw ProviderError("softnic: max_qps must be in 1..65536, got " + std::to_string(options.max_qps));
    m.fabric_id = options.fabric_id;
    while (m.fabric_id == 0) {
        std::random_device rd;
        m.fabric_id = ((uint64_t)rd() << 32) | rd();
    }
    m.node_id = options.node_id;
    std::unique_ptr<CudaBackend> cb = make_cuda_backend();
    if (cb && cb->usable()) {
        m.cuda_owner = std::move(cb);
        m.cuda = m.cuda_owner.get();
        m.device = options.cuda_device >= 0 ? options.cuda_device : m.cuda->current_device();
        // Only the progress thread switches to the device: the caller's current device stays as it was.
        if (m.device < 0 || m.device >= m.cuda->device_count())
            throw ProviderError("softnic: CUDA device " + std::to_string(m.device) + " does not exist (" +
                                std::to_string(m.cuda->device_count()) + " present)");
    }
    m.table = ShmSegment::create(table_segment_name(m.fabric_id, m.node_id),
                                 table_segment_bytes(options.max_mrs, options.max_qps));
    init_table(m.table->base(), m.fabric_id, m.node_id, options.max_mrs, options.max_qps);
    m.hdr = static_cast<SegHeader*>(m.table->base());
    m.mrs.resize(options.max_mrs);
    m.mr_tags.assign(options.max_mrs, 0);
    m.qp_slot_used.assign(options.max_qps, false);
}

SoftNicProvider::~SoftNicProvider() {
    Impl& m = *impl_;
    stop();
    __atomic_store_n(&m.hdr->alive, 0u, __ATOMIC_RELEASE);
    for (auto& [qpn, q] : m.qps) {
        m.release_qp_cuda(*q);
        m.free_control(q->sq);
        m.free_control(q->db);
    }
    m.qps.clear();
    for (auto& [cqn, c] : m.cqs) {
        m.free_control(c->ring);
        m.free_control(c->dbr);
    }
    m.cqs.clear();
    m.drop_peers_cache();
}

uint64_t SoftNicProvider::fabric_id() const { return impl_->fabric_id; }
uint64_t SoftNicProvider::node_id() const { return impl_->node_id; }
bool SoftNicProvider::has_cuda() const { return impl_->cuda != nullptr; }

Caps SoftNicProvider::query_caps() {
    Caps c;
    c.device_name = "softnic";
    c.max_qp_wr_log = 15;
    c.max_cqe_log = 22;
    c.log_max_msg = 30;
    c.cqe_version = 1;
    c.atomic_fa64 = true;
    c.atomic_masked_fa32 = true;
    c.ib = false;
    return c;
}

Address SoftNicProvider::local_address() {
    Address a;
    a.node_id = impl_->node_id;
    return a;
}

// ---------------------------------------------------------------------------------------------------
// CQs and QPs

CqInfo SoftNicProvider::create_cq(uint32_t log_size, Placement placement) {
    Impl& m = *impl_;
    if (log_size < 1 || log_size > query_caps().max_cqe_log)
        throw ProviderError("softnic: CQ log_size must be in 1..22, got " + std::to_string(log_size));
    CtlLock lock(m);
    auto c = std::make_unique<CqObj>();
    c->log_size = log_size;
    c->ring = m.alloc_control((size_t)prm::kCqeBytes << log_size, placement, "CQ ring");
    try {
        c->dbr = m.alloc_control(64, placement, "CQ doorbell record");
    } catch (...) {
        m.free_control(c->ring);
        throw;
    }
    auto* cqes = reinterpret_cast<prm::Cqe64*>(c->ring.host);
    for (uint32_t i = 0; i < (1u << log_size); ++i) cqes[i].op_own = gda::cqe_op_own(prm::kCqeInvalid, 1);
    c->cqn = m.next_cqn++;
    CqInfo info;
    info.cqn = c->cqn;
    info.log_size = log_size;
    info.cqes = reinterpret_cast<prm::Cqe64*>(c->ring.dev);
    info.dbrec = reinterpret_cast<uint32_t*>(c->dbr.dev);
    m.cqs[c->cqn] = std::move(c);
    return info;
}

QpInfo SoftNicProvider::create_qp(const CqInfo& cq_info, uint32_t log_sq, Placement placement) {
    Impl& m = *impl_;
    if (log_sq < 1 || log_sq > query_caps().max_qp_wr_log)
        throw ProviderError("softnic: log_sq must be in 1..15, got " + std::to_string(log_sq));
    CtlLock lock(m);
    CqObj& c = m.cq(cq_info.cqn);
    uint32_t slot = 0;
    while (slot < m.qp_slot_used.size() && m.qp_slot_used[slot]) ++slot;
    if (slot == m.qp_slot_used.size())
        throw ProviderError("softnic: all " + std::to_string(m.opt.max_qps) + " QPs in use (raise max_qps)");
    auto q = std::make_unique<QpObj>();
    q->slot = slot;
    q->qpn = kQpnBase + slot;
    q->log_sq = log_sq;
    q->cqn = c.cqn;
    q->sq = m.alloc_control((size_t)prm::kSendWqeBB << log_sq, placement, "send queue");
    try {
        q->db = m.alloc_control(64 + 2 * kBfHalfBytes, placement, "doorbell record / BlueFlame page");
    } catch (...) {
        m.free_control(q->sq);
        throw;
    }
    m.qp_slot_used[slot] = true;
    ++c.users;
    q->stats.qpn = q->qpn;
    m.prepare_qp_cuda(*q);
    m.publish_qp(*q);
    QpInfo info;
    info.qpn = q->qpn;
    info.log_sq = log_sq;
    info.sq = q->sq.dev;
    info.dbrec = reinterpret_cast<uint32_t*>(q->db.dev);
    info.bf = q->db.dev + 64;
    info.bf_size = kBfHalfBytes;
    info.cqn = c.cqn;
    m.qps[q->qpn] = std::move(q);
    return info;
}

void SoftNicProvider::modify_qp_rst2init(uint32_t qpn, uint32_t access) {
    Impl& m = *impl_;
    if (access & ~0xfu) throw ProviderError("softnic RST2INIT: unknown access bits " + hex(access));
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    require_state(q, prm::kQpsReset, "RST2INIT");
    q.access = access;
    m.set_state(q, prm::kQpsInit);
}

void SoftNicProvider::modify_qp_init2rtr(uint32_t qpn, const ConnectAttr& attr) {
    Impl& m = *impl_;
    if (attr.mtu < 256 || attr.mtu > 4096 || (attr.mtu & (attr.mtu - 1)))
        throw ProviderError("softnic INIT2RTR: mtu must be 256, 512, 1024, 2048 or 4096, got " + std::to_string(attr.mtu));
    if (attr.remote_qpn == 0 || attr.remote_qpn > 0xffffff)
        throw ProviderError("softnic INIT2RTR: remote_qpn " + hex(attr.remote_qpn) + " is not a valid QP number");
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    require_state(q, prm::kQpsInit, "INIT2RTR");
    q.remote_node = attr.remote.node_id;
    q.remote_qpn = attr.remote_qpn;
    m.set_state(q, prm::kQpsRtr);
}

void SoftNicProvider::modify_qp_rtr2rts(uint32_t qpn, const ConnectAttr& attr) {
    Impl& m = *impl_;
    if (attr.ack_timeout > 31 || attr.retry_cnt > 7)
        throw ProviderError("softnic RTR2RTS: ack_timeout must be 0..31 and retry_cnt 0..7");
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    require_state(q, prm::kQpsRtr, "RTR2RTS");
    // IB: each of (retry_cnt + 1) attempts waits 4.096 us * 2^ack_timeout; ack_timeout 0 = forever.
    q.retry_ns = attr.ack_timeout ? (4096ull << attr.ack_timeout) * (attr.retry_cnt + 1ull) : 0;
    m.set_state(q, prm::kQpsRts);
    m.prepare_peer_cuda(q.remote_node);
}

void SoftNicProvider::modify_qp_to_reset(uint32_t qpn) {
    Impl& m = *impl_;
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    m.release_qp_cuda(q);
    q.pending.clear();
    q.cuda_unrecorded = false;
    m.clean_cq(q);
    // What rdma-core does in software on a transition to RESET: the doorbell record starts over,
    // and so does the producer index the next poster context will use.
    auto* dbr = reinterpret_cast<uint32_t*>(q.db.host);
    __atomic_store_n(&dbr[prm::kRecvDbr], 0u, __ATOMIC_RELEASE);
    __atomic_store_n(&dbr[prm::kSendDbr], 0u, __ATOMIC_RELEASE);
    q.ci = 0;
    q.last_dbr = 0;
    q.head_seen_ns = q.head_retry_ns = 0;
    q.access = 0;
    q.remote_node = 0;
    q.remote_qpn = 0;
    q.retry_ns = 0;
    m.set_state(q, prm::kQpsReset);
}

void SoftNicProvider::modify_qp_to_error(uint32_t qpn) {
    Impl& m = *impl_;
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    m.set_state(q, prm::kQpsErr);
}

uint8_t SoftNicProvider::query_qp_state(uint32_t qpn) {
    CtlLock lock(*impl_);
    return impl_->qp(qpn).state;
}

void SoftNicProvider::destroy_qp(uint32_t qpn) {
    Impl& m = *impl_;
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    m.release_qp_cuda(q);
    m.close_retired_ipc();   // a control call: the engine thread leaves these to us
    m.clean_cq(q);
    m.free_control(q.sq);
    m.free_control(q.db);
    QpEntry empty{};
    seq_publish(&qp_entries(m.hdr)[q.slot], &empty, sizeof(empty));
    m.qp_slot_used[q.slot] = false;
    if (auto it = m.cqs.find(q.cqn); it != m.cqs.end()) --it->second->users;
    m.qps.erase(qpn);
}

void SoftNicProvider::destroy_cq(uint32_t cqn) {
    Impl& m = *impl_;
    CtlLock lock(m);
    CqObj& c = m.cq(cqn);
    if (c.users)
        throw ProviderError("softnic: CQ " + std::to_string(cqn) + " still has " + std::to_string(c.users) +
                            " QP(s); destroy them first");
    m.free_control(c.ring);
    m.free_control(c.dbr);
    m.cqs.erase(cqn);
}

}  // namespace nic
}  // namespace pyep
