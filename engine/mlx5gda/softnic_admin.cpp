// The softnic's control plane, part 2: memory registration, shared host buffers, progress control,
// fault injection and diagnostics.
#include <unistd.h>

#include <cstring>

#include "mlx5gda/softnic_internal.h"

namespace pyep {
namespace nic {

using namespace softnic;
using Impl = SoftNicProvider::Impl;

// ---------------------------------------------------------------------------------------------------
// Memory

MrInfo SoftNicProvider::reg_mr(void* addr, uint64_t length, uint32_t access) {
    Impl& m = *impl_;
    if (!addr || length == 0) throw ProviderError("softnic reg_mr: address and length must be non-zero");
    if (access & ~0xfu) throw ProviderError("softnic reg_mr: unknown access bits " + hex(access));
    if ((access & (prm::kAccessRemoteWrite | prm::kAccessRemoteAtomic)) && !(access & prm::kAccessLocalWrite))
        throw ProviderError("softnic reg_mr: REMOTE_WRITE / REMOTE_ATOMIC require LOCAL_WRITE (as in verbs)");
    const uint64_t a = (uint64_t)(uintptr_t)addr;
    if (a + length < a) throw ProviderError("softnic reg_mr: range wraps around the address space");
    CtlLock lock(m);
    auto mr = std::make_unique<MrObj>();
    CudaPointer cp;
    if (m.cuda && m.cuda->query_pointer(addr, &cp) && cp.device) {
        mr->kind = cp.ipc_ok ? MemKind::Cuda : MemKind::CudaPrivate;
        mr->device = cp.ordinal;
        mr->seg_offset = a - cp.alloc_base;
        std::memcpy(mr->ipc, cp.ipc, sizeof(mr->ipc));
    } else {
        mr->kind = MemKind::HostPrivate;
        for (auto& [index, seg] : m.buffers) {
            const uint64_t base = (uint64_t)(uintptr_t)seg->base();
            if (a >= base && a < base + seg->size()) {
                if (a + length > base + seg->size())
                    throw ProviderError("softnic reg_mr: range runs past the end of the alloc_host buffer at " + hex(base));
                mr->kind = MemKind::HostShared;
                mr->seg_index = index;
                mr->seg_offset = a - base;
            }
        }
    }
    uint32_t slot = 0;
    while (slot < m.mrs.size() && m.mrs[slot]) ++slot;
    if (slot == m.mrs.size()) throw ProviderError("softnic: all " + std::to_string(m.opt.max_mrs) + " MRs in use");
    const uint8_t tag = ++m.mr_tags[slot];
    mr->info.addr = a;
    mr->info.length = length;
    mr->info.access = access;
    mr->info.lkey = mr->info.rkey = ((slot + 1) << 8) | tag;
    const MrInfo info = mr->info;
    m.mrs[slot] = std::move(mr);
    m.publish_mr(slot);
    return info;
}

void SoftNicProvider::dereg_mr(uint32_t lkey) {
    Impl& m = *impl_;
    CtlLock lock(m);
    const uint32_t slot = (lkey >> 8) - 1;
    if ((lkey >> 8) == 0 || slot >= m.mrs.size() || !m.mrs[slot] || m.mrs[slot]->info.lkey != lkey)
        throw ProviderError("softnic dereg_mr: no MR with lkey " + hex(lkey));
    m.mrs[slot].reset();
    m.publish_mr(slot);
}

void* SoftNicProvider::alloc_host(uint64_t bytes) {
    Impl& m = *impl_;
    if (bytes == 0) throw ProviderError("softnic alloc_host: size must be > 0");
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    bytes = (bytes + page - 1) / page * page;
    CtlLock lock(m);
    const uint32_t index = m.next_buffer++;
    auto seg = ShmSegment::create(buffer_segment_name(m.fabric_id, m.node_id, index), bytes);
    void* base = seg->base();
    m.buffers[index] = std::move(seg);
    return base;
}

void SoftNicProvider::free_host(void* ptr) {
    Impl& m = *impl_;
    CtlLock lock(m);
    for (auto it = m.buffers.begin(); it != m.buffers.end(); ++it) {
        if (it->second->base() != ptr) continue;
        for (const auto& mr : m.mrs)
            if (mr && mr->kind == MemKind::HostShared && mr->seg_index == it->first)
                throw ProviderError("softnic free_host: MR " + hex(mr->info.lkey) + " still covers this buffer");
        m.buffers.erase(it);
        return;
    }
    throw ProviderError("softnic free_host: " + hex((uint64_t)(uintptr_t)ptr) + " is not an alloc_host buffer");
}

// ---------------------------------------------------------------------------------------------------
// Progress control

void SoftNicProvider::start() {
    Impl& m = *impl_;
    bool expected = false;
    if (!m.running.compare_exchange_strong(expected, true)) return;
    m.thread = std::thread([&m] { m.thread_main(); });
}

void SoftNicProvider::stop() {
    Impl& m = *impl_;
    if (!m.running.exchange(false)) return;
    if (m.thread.joinable()) m.thread.join();
}

bool SoftNicProvider::running() const { return impl_->running.load(); }

uint32_t SoftNicProvider::progress_once() {
    Impl& m = *impl_;
    if (m.running.load()) throw ProviderError("softnic progress_once: the progress thread is running; stop() it first");
    CtlLock lock(m);
    // CUDA work (streams, IPC mappings, peer access) belongs to the softnic's device, whatever the
    // calling thread's current device is.
    const int saved = m.cuda ? m.cuda->current_device() : -1;
    if (m.cuda) m.cuda->set_device(m.device);
    const uint32_t work = m.pass();
    if (m.cuda) m.cuda->set_device(saved);
    return work;
}

// ---------------------------------------------------------------------------------------------------
// Fault injection

void SoftNicProvider::drop_peer(uint64_t node, bool blackhole, int64_t retry_ns) {
    Impl& m = *impl_;
    CtlLock lock(m);
    DropRule* slot = nullptr;
    for (auto& r : m.drops)
        if (r.active && r.node == node) slot = &r;
    for (auto& r : m.drops)
        if (!slot && !r.active) slot = &r;
    if (!slot) throw ProviderError("softnic drop_peer: more than " + std::to_string(kMaxDropRules) + " drop rules");
    slot->node = node;
    slot->active = 1;
    slot->blackhole = blackhole ? 1 : 0;
    slot->retry_ns = retry_ns;
    write_drop_rules(m.hdr, m.drops);
}

void SoftNicProvider::restore_peer(uint64_t node) {
    Impl& m = *impl_;
    CtlLock lock(m);
    for (auto& r : m.drops)
        if (r.active && r.node == node) r = DropRule{};
    write_drop_rules(m.hdr, m.drops);
}

void SoftNicProvider::set_qp_delay(uint32_t qpn, uint64_t delay_ns) {
    CtlLock lock(*impl_);
    impl_->qp(qpn).delay_ns = delay_ns;
}

void SoftNicProvider::set_peer_delay(uint64_t node, uint64_t delay_ns) {
    CtlLock lock(*impl_);
    if (delay_ns) impl_->peer_delay_ns[node] = delay_ns;
    else impl_->peer_delay_ns.erase(node);
}

void SoftNicProvider::fail_after(uint32_t qpn, uint64_t n, uint8_t syndrome) {
    if (syndrome == 0) throw ProviderError("softnic fail_after: syndrome 0 is success, not a failure");
    CtlLock lock(*impl_);
    QpObj& q = impl_->qp(qpn);
    q.fail_after = (int64_t)n;
    q.fail_syndrome = syndrome;
}

void SoftNicProvider::force_error(uint32_t qpn) {
    Impl& m = *impl_;
    CtlLock lock(m);
    QpObj& q = m.qp(qpn);
    m.set_state(q, prm::kQpsErr);
    q.stats.last_error = "node " + std::to_string(m.node_id) + " QP " + hex(qpn) + " forced into error (fault injection)";
    m.event(q.stats.last_error);
}

void SoftNicProvider::invalidate_key(uint32_t key) {
    Impl& m = *impl_;
    CtlLock lock(m);
    const uint32_t slot = (key >> 8) - 1;
    if ((key >> 8) == 0 || slot >= m.mrs.size() || !m.mrs[slot] || m.mrs[slot]->info.lkey != key)
        throw ProviderError("softnic invalidate_key: no MR with key " + hex(key));
    m.mrs[slot]->valid = false;
    m.publish_mr(slot);
}

void SoftNicProvider::clear_faults() {
    Impl& m = *impl_;
    CtlLock lock(m);
    for (auto& r : m.drops) r = DropRule{};
    write_drop_rules(m.hdr, m.drops);
    m.peer_delay_ns.clear();
    for (auto& [qpn, q] : m.qps) {
        q->delay_ns = 0;
        q->fail_after = -1;
    }
}

// ---------------------------------------------------------------------------------------------------
// Diagnostics

QpStats SoftNicProvider::qp_stats(uint32_t qpn) {
    CtlLock lock(*impl_);
    const QpObj& q = impl_->qp(qpn);
    QpStats s = q.stats;
    s.qpn = q.qpn;
    s.state = q.state;
    s.remote_node = q.remote_node;
    s.remote_qpn = q.remote_qpn;
    s.consumer_index = q.ci;
    s.pending = q.pending.size();
    return s;
}

CqStats SoftNicProvider::cq_stats(uint32_t cqn) {
    CtlLock lock(*impl_);
    const CqObj& c = impl_->cq(cqn);
    CqStats s;
    s.cqn = c.cqn;
    s.log_size = c.log_size;
    s.producer_index = c.pi;
    s.consumer_index = gda::be32toh_(__atomic_load_n(reinterpret_cast<uint32_t*>(c.dbr.host), __ATOMIC_ACQUIRE)) &
                       prm::kCqCiMask;
    s.overrun = c.overrun;
    s.error = c.error;
    return s;
}

std::vector<uint32_t> SoftNicProvider::qpns() {
    CtlLock lock(*impl_);
    std::vector<uint32_t> out;
    for (auto& [qpn, q] : impl_->qps) out.push_back(qpn);
    return out;
}

std::vector<std::string> SoftNicProvider::drain_events() {
    CtlLock lock(*impl_);
    std::vector<std::string> out(impl_->events.begin(), impl_->events.end());
    impl_->events.clear();
    return out;
}

PeerInfo SoftNicProvider::peer_info(const std::vector<uint32_t>& qpns, const std::vector<MrInfo>& mrs) {
    Impl& m = *impl_;
    CtlLock lock(m);
    PeerInfo info;
    info.fabric_id = m.fabric_id;
    info.node_id = m.node_id;
    info.host_id = this_host_id();
    info.pid = (uint32_t)getpid();
    for (uint32_t qpn : qpns) m.qp(qpn);  // throws for a QP that is not ours
    for (const MrInfo& mr : mrs) {
        const uint32_t slot = (mr.rkey >> 8) - 1;
        if ((mr.rkey >> 8) == 0 || slot >= m.mrs.size() || !m.mrs[slot] || m.mrs[slot]->info.rkey != mr.rkey)
            throw ProviderError("softnic peer_info: rkey " + hex(mr.rkey) + " is not an MR of this softnic");
        info.mrs.push_back(m.mrs[slot]->info);  // what the table says, not what the caller remembered
    }
    info.qpns = qpns;
    return info;
}

}  // namespace nic
}  // namespace pyep
