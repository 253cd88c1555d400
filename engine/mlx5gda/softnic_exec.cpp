// The softnic's data path, part 2: one WQE, checked in the order the NICs check it and executed.
//
//   requester: QP state, ctrl fields (wqe_index, qpn, ds, opcode/opmod), injected failures, then the
//              gather list / fetch destination against local MRs (LOCAL_* syndromes);
//   wire:      added delay, drop rules on either side, responder alive, responder QP in RTR/RTS and
//              connected back to this QP; otherwise retry until the retry time is spent
//              (TRANSPORT_RETRY_EXC_ERR) or, when black-holed, forever;
//   responder: QP remote-access enables, rkey valid, range inside the MR, MR rights (REMOTE_ACCESS_ERR),
//              atomic alignment (REMOTE_INVAL_REQ_ERR, as IB NAKs it as an invalid request);
//   execute:   memcpy / host atomics, or copies / an atomic kernel on the QP's CUDA stream.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "mlx5gda/softnic_internal.h"

namespace pyep {
namespace nic {

using namespace softnic;
using Impl = SoftNicProvider::Impl;

namespace {

constexpr uint64_t kPeerRecheckNs = 50000000ull;  // how often a peer's liveness is re-checked
constexpr uint64_t kMaxMsgBytes = 1ull << 30;     // Caps::log_max_msg

uint32_t be32_at(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return gda::be32toh_(v);
}
uint64_t be64_at(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return gda::be64toh_(v);
}

bool in_range(uint64_t addr, uint64_t len, uint64_t base, uint64_t size) {
    return addr >= base && len <= size && addr - base <= size - len;
}

bool has_cuda_pending(const QpObj& q) {
    if (q.cuda_unrecorded) return true;
    for (const auto& c : q.pending)
        if (c.cuda) return true;
    return false;
}

// The outcome of one check: go on, wait and retry later, or fail the WQE with a syndrome.
struct Verdict {
    enum Kind { Ok, Stall, Fail } kind = Ok;
    uint8_t syndrome = 0;
    uint8_t vendor = 0;
    std::string why;
};
Verdict ok() { return Verdict{}; }
Verdict stall() { return Verdict{Verdict::Stall, 0, 0, ""}; }
Verdict failure(uint8_t syndrome, uint8_t vendor, std::string why) {
    return Verdict{Verdict::Fail, syndrome, vendor, std::move(why)};
}

struct LocalSeg {
    uint64_t addr;
    uint32_t len;
    uint32_t lkey;
    Span span;
};

// The parsed, locally validated WQE.
struct Work {
    gda::DecodedWqe d;
    bool write = false;
    uint32_t op_size = 0;  // atomic operand bytes
    LocalSeg segs[64];
    uint32_t nsegs = 0;
    uint64_t total = 0;    // write payload bytes
};

Verdict check_ctrl(const QpObj& q, Work& w) {
    const gda::DecodedWqe& d = w.d;
    if (q.state != prm::kQpsRts)
        return failure(prm::kSyndLocalQpOpErr, kVendQpNotRts,
                       std::string("doorbell rung while the QP is in ") + state_name(q.state) + " (needs RTS)");
    if (d.wqe_index != (uint16_t)q.ci)
        return failure(prm::kSyndLocalQpOpErr, kVendBadWqeIndex,
                       "ctrl.wqe_index " + std::to_string(d.wqe_index) + ", expected " + std::to_string((uint16_t)q.ci));
    if (d.qpn != q.qpn) return failure(prm::kSyndLocalQpOpErr, kVendBadQpn, "ctrl.qpn " + hex(d.qpn) + " on QP " + hex(q.qpn));
    bool ds_ok = d.ds != 0;
    switch (d.opcode) {
        case prm::kOpNop: break;
        case prm::kOpRdmaWrite:
            w.write = true;
            ds_ok &= d.ds >= 2;
            break;
        case prm::kOpAtomicFa:
            w.op_size = 8;
            ds_ok &= d.ds == 4;
            break;
        case prm::kOpAtomicMaskedFa:
            if (d.opmod == prm::kOpmodExtAtomic4B) w.op_size = 4;
            else if (d.opmod == prm::kOpmodExtAtomic8B) w.op_size = 8;
            else return failure(prm::kSyndLocalQpOpErr, kVendBadOpcode, "masked FA opmod " + hex(d.opmod));
            ds_ok &= d.ds == 4;
            break;
        default:
            return failure(prm::kSyndLocalQpOpErr, kVendBadOpcode, "opcode " + hex(d.opcode) + " is not executed by the softnic");
    }
    if (!ds_ok) return failure(prm::kSyndLocalQpOpErr, kVendBadDs, "ds " + std::to_string(d.ds) + " for opcode " + hex(d.opcode));
    return ok();
}

Verdict gather_local(const Impl& m, const uint8_t* wqe, Work& w) {
    for (uint32_t off = w.write ? 32 : 48; off + 16 <= w.d.ds * prm::kSegBytes; off += 16) {
        const uint32_t bc = be32_at(wqe + off);
        if (bc & 0x80000000u) return failure(prm::kSyndLocalQpOpErr, kVendBadOpcode, "inline data segments are not supported");
        w.segs[w.nsegs++] = LocalSeg{be64_at(wqe + off + 8), bc, be32_at(wqe + off + 4), Span{}};
        w.total += bc;
    }
    if (w.write && w.total > kMaxMsgBytes)
        return failure(prm::kSyndLocalLengthErr, kVendMsgLen, "message of " + std::to_string(w.total) + " bytes");
    if (!w.write && (w.nsegs != 1 || w.segs[0].len != w.op_size))
        return failure(prm::kSyndLocalLengthErr, kVendFetchLen,
                       "fetch data segment of " + std::to_string(w.nsegs ? w.segs[0].len : 0) + " bytes for a " +
                           std::to_string(w.op_size) + "-byte atomic");
    for (uint32_t i = 0; i < w.nsegs; ++i) {
        LocalSeg& s = w.segs[i];
        if (s.len == 0) continue;
        const uint32_t slot = (s.lkey >> 8) - 1;
        const MrObj* mr = (s.lkey >> 8) && slot < m.mrs.size() ? m.mrs[slot].get() : nullptr;
        if (!mr || mr->info.lkey != s.lkey || !mr->valid)
            return failure(prm::kSyndLocalProtErr, kVendLkey, "lkey " + hex(s.lkey) + " is not a valid local MR");
        if (!in_range(s.addr, s.len, mr->info.addr, mr->info.length))
            return failure(prm::kSyndLocalProtErr, kVendLbounds,
                           "local range " + hex(s.addr) + "+" + std::to_string(s.len) + " outside MR " + hex(s.lkey));
        if (!w.write && !(mr->info.access & prm::kAccessLocalWrite))
            return failure(prm::kSyndLocalProtErr, kVendLaccess, "fetch MR " + hex(s.lkey) + " lacks LOCAL_WRITE");
        s.span = Span{reinterpret_cast<uint8_t*>(s.addr), mr->kind};
    }
    return ok();
}

// Why a request cannot reach its responder right now.
struct PathFault {
    std::string why;
    bool blackhole = false;
    int64_t retry_ns = -1;  // < 0: the QP's own retry time
    uint8_t vendor = kVendRetry;
};

bool dropped(const DropRule* rules, uint64_t node, const std::string& why, PathFault* f) {
    for (uint32_t i = 0; i < kMaxDropRules; ++i) {
        if (!rules[i].active || rules[i].node != node) continue;
        *f = PathFault{why, rules[i].blackhole != 0, rules[i].retry_ns, kVendDropped};
        return true;
    }
    return false;
}

bool find_path(Impl& m, const QpObj& q, uint64_t now, PeerView** out, QpEntry* rq, PathFault* f) {
    const std::string peer_name = "node " + std::to_string(q.remote_node);
    if (dropped(m.drops, q.remote_node, "traffic to " + peer_name + " is dropped (fault injection)", f)) return false;
    PeerView* p = m.peer(q.remote_node, now);
    if (!p->alive) {
        f->why = peer_name + " is not reachable (no live softnic with that id in this fabric)";
        return false;
    }
    DropRule theirs[kMaxDropRules];
    if (p->base != m.hdr && read_drop_rules(static_cast<const SegHeader*>(p->base), theirs) &&
        dropped(theirs, m.node_id, peer_name + " drops traffic from node " + std::to_string(m.node_id) + " (fault injection)", f))
        return false;
    const auto* ph = static_cast<const SegHeader*>(p->base);
    const uint32_t rslot = q.remote_qpn - kQpnBase;
    const std::string rname = "responder QP " + hex(q.remote_qpn);
    if (q.remote_qpn < kQpnBase || rslot >= ph->max_qps ||
        !seq_snapshot(&qp_entries(p->base)[rslot], rq, sizeof(*rq)) || rq->qpn != q.remote_qpn) {
        f->why = rname + " does not exist on " + peer_name;
        return false;
    }
    if (rq->state != prm::kQpsRtr && rq->state != prm::kQpsRts) {
        f->why = rname + " is in " + state_name(rq->state) + " (needs RTR or RTS)";
        return false;
    }
    if (rq->remote_node != m.node_id || rq->remote_qpn != q.qpn) {
        f->why = rname + " is connected to node " + std::to_string(rq->remote_node) + " QP " + hex(rq->remote_qpn) +
                 ", not to this QP";
        return false;
    }
    *out = p;
    return true;
}

Verdict reach_responder(Impl& m, QpObj& q, uint64_t now, PeerView** p, QpEntry* rq) {
    uint64_t delay = q.delay_ns;
    if (auto it = m.peer_delay_ns.find(q.remote_node); it != m.peer_delay_ns.end()) delay += it->second;
    if (delay) {
        if (!q.head_seen_ns) q.head_seen_ns = now;
        if (now - q.head_seen_ns < delay) return stall();
    }
    PathFault f;
    if (find_path(m, q, now, p, rq, &f)) return ok();
    if (f.blackhole) return stall();
    if (!q.head_retry_ns) q.head_retry_ns = now;
    if (f.retry_ns < 0 && q.retry_ns == 0) return stall();  // ack_timeout 0: retry forever
    const uint64_t limit = f.retry_ns >= 0 ? (uint64_t)f.retry_ns : q.retry_ns;
    if (now - q.head_retry_ns < limit) return stall();
    return failure(prm::kSyndTransportRetryExcErr, f.vendor,
                   f.why + "; retries exhausted after " + std::to_string(limit / 1000000.0) + " ms");
}

Verdict resolve_target(Impl& m, const QpObj& q, PeerView& p, const QpEntry& rq, const Work& w, Span* target) {
    const uint32_t need = w.write ? prm::kAccessRemoteWrite : prm::kAccessRemoteAtomic;
    if (!(rq.access & need))
        return failure(prm::kSyndRemoteAccessErr, kVendQpAccess,
                       "responder QP " + hex(q.remote_qpn) + " was not enabled for remote " + (w.write ? "write" : "atomic"));
    const uint64_t rlen = w.write ? w.total : w.op_size;
    if (rlen == 0) return ok();  // zero-length write: no rkey check (IB)
    const auto* ph = static_cast<const SegHeader*>(p.base);
    const uint32_t rkey = w.d.wr.rkey;
    const uint64_t raddr = w.d.wr.raddr;
    const uint32_t mslot = (rkey >> 8) - 1;
    const std::string node = "node " + std::to_string(q.remote_node);
    MrEntry e{};
    if ((rkey >> 8) == 0 || mslot >= ph->max_mrs || !seq_snapshot(&mr_entries(p.base)[mslot], &e, sizeof(e)) ||
        e.key != rkey || !e.valid)
        return failure(prm::kSyndRemoteAccessErr, kVendRkey, "rkey " + hex(rkey) + " is not a valid MR on " + node);
    if (!in_range(raddr, rlen, e.addr, e.length))
        return failure(prm::kSyndRemoteAccessErr, kVendRbounds,
                       "remote range " + hex(raddr) + "+" + std::to_string(rlen) + " outside MR " + hex(rkey));
    if (!(e.access & need))
        return failure(prm::kSyndRemoteAccessErr, kVendRaccess, "MR " + hex(rkey) + " lacks REMOTE_" + (w.write ? "WRITE" : "ATOMIC"));
    if (!w.write && (raddr % w.op_size))
        return failure(prm::kSyndRemoteInvalReqErr, kVendAlign,
                       "atomic target " + hex(raddr) + " not " + std::to_string(w.op_size) + "-byte aligned");
    const MemKind kind = (MemKind)e.kind;
    const uint64_t off = e.seg_offset + (raddr - e.addr);
    if (p.pid == (int32_t)getpid()) {
        *target = Span{reinterpret_cast<uint8_t*>(raddr), kind};
    } else if (kind == MemKind::HostShared) {
        auto& seg = p.buffers[e.seg_index];
        if (!seg) seg = ShmSegment::open(buffer_segment_name(m.fabric_id, q.remote_node, e.seg_index));
        if (!seg || off + rlen > seg->size()) {
            p.buffers.erase(e.seg_index);
            return failure(prm::kSyndRemoteOpErr, kVendNotShareable,
                           "shared buffer " + std::to_string(e.seg_index) + " of " + node + " cannot be mapped");
        }
        *target = Span{static_cast<uint8_t*>(seg->base()) + off, kind};
    } else if (kind == MemKind::Cuda && m.cuda) {
        const std::string handle(reinterpret_cast<const char*>(e.ipc), sizeof(e.ipc));
        void*& base = p.ipc[handle];
        if (!base) base = m.cuda->open_ipc(e.ipc);
        if (!base) {
            p.ipc.erase(handle);
            return failure(prm::kSyndRemoteOpErr, kVendDma,
                           "cannot open the CUDA IPC handle of MR " + hex(rkey) + ": " + m.cuda->last_error());
        }
        *target = Span{static_cast<uint8_t*>(base) + off, kind};
    } else {
        return failure(prm::kSyndRemoteAccessErr, kVendNotShareable,
                       "MR " + hex(rkey) + " of " + node +
                           (kind == MemKind::HostPrivate ? " is private host memory of another process (use alloc_host)"
                                                         : " is GPU memory this softnic cannot open"));
    }
    // Kernels atomically updating another GPU's memory need peer access (copies would be staged
    // without it); enabled once per device pair.
    if (target->gpu() && m.cuda && e.device >= 0 && e.device != m.device &&
        std::find(m.peer_access.begin(), m.peer_access.end(), e.device) == m.peer_access.end()) {
        if (!m.cuda->enable_peer(m.device, e.device))
            m.event("no peer access from GPU " + std::to_string(m.device) + " to GPU " + std::to_string(e.device) + ": " +
                    m.cuda->last_error());
        m.peer_access.push_back(e.device);
    }
    return ok();
}

bool ensure_stream(Impl& m, QpObj& q) {
    if (q.stream && q.scratch) return true;
    if (!q.stream) q.stream = m.cuda->create_stream();
    if (!q.scratch) {
        void* dev = nullptr;
        q.scratch = static_cast<uint64_t*>(m.cuda->alloc_host_mapped(8u << q.log_sq, &dev));
        q.scratch_dev = static_cast<uint64_t*>(dev);
    }
    return q.stream && q.scratch;
}

Verdict run(Impl& m, QpObj& q, const uint8_t* wqe, const Work& w, const Span& target, Completion& c) {
    bool gpu = target.gpu();
    for (uint32_t i = 0; i < w.nsegs; ++i) gpu |= w.segs[i].span.gpu();
    // Host-executed work must not overtake work still queued on the QP's stream.
    const bool host_step = !(w.write ? gpu : target.gpu());
    if (host_step && has_cuda_pending(q)) return stall();
    if (gpu && !ensure_stream(m, q))
        return failure(prm::kSyndRemoteOpErr, kVendDma, "cannot create the QP's CUDA stream: " + m.cuda->last_error());
    const uint32_t slot = (uint32_t)(q.ci & ((1u << q.log_sq) - 1));
    if (w.write) {
        uint64_t off = 0;
        for (uint32_t i = 0; i < w.nsegs; ++i) {
            const LocalSeg& s = w.segs[i];
            if (!s.len) continue;
            if (gpu) {
                if (!m.cuda->copy_async(q.stream, target.ptr + off, s.span.ptr, s.len))
                    return failure(prm::kSyndRemoteOpErr, kVendDma, "CUDA copy failed: " + m.cuda->last_error());
            } else {
                std::memcpy(target.ptr + off, s.span.ptr, s.len);
            }
            off += s.len;
        }
        if (!gpu) __atomic_thread_fence(__ATOMIC_RELEASE);
        q.stats.bytes += w.total;
        c.byte_cnt = (uint32_t)w.total;
    } else {
        const bool masked = w.d.opcode == prm::kOpAtomicMaskedFa;
        const uint64_t boundary = masked ? (w.op_size == 4 ? be32_at(wqe + 36) : be64_at(wqe + 40)) : 0;
        const uint64_t add = w.op_size == 4 ? be32_at(wqe + 32) : be64_at(wqe + 32);
        const Span fetch = w.segs[0].span;
        if (target.gpu()) {
            void* fetch_dev = fetch.gpu() ? (void*)fetch.ptr : (void*)(q.scratch_dev + slot);
            if (!m.cuda->atomic_async(q.stream, target.ptr, w.op_size, add, boundary, fetch_dev))
                return failure(prm::kSyndRemoteOpErr, kVendDma, "CUDA atomic failed: " + m.cuda->last_error());
            if (!fetch.gpu()) {  // staged in pinned scratch, copied out when the stream is done
                c.copy_dst = fetch.ptr;
                c.copy_slot = slot;
                c.copy_size = w.op_size;
            }
        } else {
            const uint64_t old = host_atomic_add(target.ptr, w.op_size, add, boundary);
            if (fetch.gpu()) {
                q.scratch[slot] = old;  // little-endian: the low op_size bytes are the value
                if (!m.cuda->copy_async(q.stream, fetch.ptr, q.scratch + slot, w.op_size))
                    return failure(prm::kSyndLocalProtErr, kVendDma,
                                   "CUDA copy of the fetched value failed: " + m.cuda->last_error());
            } else {
                std::memcpy(fetch.ptr, &old, w.op_size);
            }
        }
        ++q.stats.atomics;
        c.byte_cnt = w.op_size;
    }
    if (gpu) {
        c.cuda = true;
        q.cuda_unrecorded = true;
    }
    return ok();
}

}  // namespace

PeerView* Impl::peer(uint64_t node, uint64_t now, bool control) {
    auto& slot = peers[node];
    if (!slot) {
        slot = std::make_unique<PeerView>();
        slot->node = node;
    }
    PeerView& p = *slot;
    if (node == node_id) {
        p.base = hdr;
        p.pid = (int32_t)getpid();
        p.alive = true;
        return &p;
    }
    if (control) close_retired_ipc();
    // Dead peers too: a QP whose head WQE targets a dead node asks on every pass, and a probe maps and
    // unmaps the node's table (a killed softnic never unlinks it), which interrupts every thread of
    // this process (TLB shootdowns) while the survivors' kernels run.
    if (!control && p.checked_ns && now - p.checked_ns < kPeerRecheckNs) return &p;
    p.checked_ns = now;
    for (int attempt = 0; attempt < 2; ++attempt) {
        if (!p.table) {
            auto seg = ShmSegment::open(table_segment_name(fabric_id, node));
            if (!seg || !check_table(seg->base(), seg->size(), fabric_id, node).empty()) {
                p.alive = false;
                return &p;
            }
            p.table = std::move(seg);
            p.base = p.table->base();
        }
        const auto* h = static_cast<const SegHeader*>(p.base);
        p.pid = __atomic_load_n(&h->pid, __ATOMIC_ACQUIRE);
        p.alive = __atomic_load_n(&h->alive, __ATOMIC_ACQUIRE) && process_alive(p.pid);
        if (p.alive) return &p;
        // The owner is gone. A softnic that comes back under this node id creates a new segment under
        // the same name: forget the old one and look once more (a restarted peer is reachable at once,
        // and prepare_peer_cuda opens its memory up front). Its IPC mappings are closed by a control
        // call, never here on the engine thread (see retired_ipc).
        for (auto& [handle, base] : p.ipc) retired_ipc.push_back(base);
        p.ipc.clear();
        p.buffers.clear();
        p.table.reset();
        p.base = nullptr;
        if (control) close_retired_ipc();
    }
    return &p;
}

void Impl::close_retired_ipc() {
    for (void* base : retired_ipc)
        if (cuda) cuda->close_ipc(base);
    retired_ipc.clear();
}

void Impl::drop_peers_cache() {
    for (auto& [node, p] : peers)
        for (auto& [handle, base] : p->ipc)
            if (cuda) cuda->close_ipc(base);
    peers.clear();
    close_retired_ipc();
}

Step Impl::execute(QpObj& q, const uint8_t* wqe, uint64_t now) {
    Work w;
    w.d = gda::decode_wqe(wqe);
    Completion c;
    c.wqe_index = (uint16_t)q.ci;
    c.wqe_opcode = w.d.opcode;
    c.signaled = w.d.wr.signaled;
    if (q.state == prm::kQpsErr) {
        c.error = true;
        c.syndrome = prm::kSyndWrFlushErr;
        c.vendor = kVendFlush;
        q.pending.push_back(c);
        ++q.stats.flushed;
        return Step::Done;
    }
    Verdict v = check_ctrl(q, w);
    if (v.kind == Verdict::Ok && q.fail_after == 0) {
        q.fail_after = -1;
        v = failure(q.fail_syndrome, kVendInjected, "injected failure (fail_after)");
    }
    Span target;
    if (v.kind == Verdict::Ok && w.d.opcode != prm::kOpNop) {
        PeerView* p = nullptr;
        QpEntry rq{};
        v = gather_local(*this, wqe, w);
        if (v.kind == Verdict::Ok) v = reach_responder(*this, q, now, &p, &rq);
        if (v.kind == Verdict::Ok) v = resolve_target(*this, q, *p, rq, w, &target);
        if (v.kind == Verdict::Ok) v = run(*this, q, wqe, w, target, c);
    }
    if (v.kind == Verdict::Stall) return Step::Stall;
    if (v.kind == Verdict::Fail) return fail(q, c, v.syndrome, v.vendor, v.why);
    q.pending.push_back(c);
    ++q.stats.wqes;
    if (q.fail_after > 0) --q.fail_after;
    q.head_seen_ns = q.head_retry_ns = 0;
    return Step::Done;
}

void Impl::prepare_qp_cuda(QpObj& q) {
    if (cuda && !ensure_stream(*this, q))
        event("QP " + hex(q.qpn) + ": CUDA stream/scratch not created up front: " + cuda->last_error());
}

void Impl::prepare_peer_cuda(uint64_t node) {
    // A control probe first, in every build: a QP just connected to a restarted node must not see the
    // dead predecessor the engine cached (it re-probes only every kPeerRecheckNs).
    PeerView* p = peer(node, gda::now_ns(), true);
    if (!cuda) return;
    if (!p->alive || !p->base || p->pid == (int32_t)getpid()) return;
    const auto* ph = static_cast<const SegHeader*>(p->base);
    for (uint32_t i = 0; i < ph->max_mrs; ++i) {
        MrEntry e{};
        if (!seq_snapshot(&mr_entries(p->base)[i], &e, sizeof(e)) || !e.valid || (MemKind)e.kind != MemKind::Cuda)
            continue;
        const std::string handle(reinterpret_cast<const char*>(e.ipc), sizeof(e.ipc));
        void*& base = p->ipc[handle];
        if (!base) base = cuda->open_ipc(e.ipc);
        if (!base) {
            p->ipc.erase(handle);
            event("node " + std::to_string(node) + " MR " + hex(e.key) + ": IPC handle not opened up front: " +
                  cuda->last_error());
            continue;
        }
        if (e.device >= 0 && e.device != device &&
            std::find(peer_access.begin(), peer_access.end(), e.device) == peer_access.end()) {
            if (!cuda->enable_peer(device, e.device))
                event("no peer access from GPU " + std::to_string(device) + " to GPU " + std::to_string(e.device) +
                      ": " + cuda->last_error());
            peer_access.push_back(e.device);
        }
    }
}

}  // namespace nic
}  // namespace pyep
