// The host-side NIC provider interface: everything the engine asks of "a NIC" to build RC QPs that GPU
// threads then drive directly (qp.h). Two implementations:
//   - DevxProvider (devx_provider.*): a real ConnectX through rdma-core DevX PRM commands.
//   - SoftNicProvider (softnic*.*): the software NIC executing the same rings, in this process.
// The setup sequence (CQ, QP, RST->INIT->RTR->RTS, MRs, address exchange, reconnect) is identical for
// both, which is how it is exercised end to end on machines without a NIC.
#pragma once

#include <stdint.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx5gda/prm.h"
#include "mlx5gda/qp.h"

namespace pyep {
namespace nic {

// Where rings, CQEs and doorbell records live. The NIC must be able to DMA them and the posting threads
// must be able to load/store them: device memory (UMEM over DMA-BUF or peer memory on real HW),
// host memory mapped into the GPU's address space, or plain host memory (CPU posters / CI).
enum class Placement : int { Host = 0, HostMapped = 1, Device = 2 };

struct Caps {
    std::string device_name;
    uint32_t max_qp_wr_log = 15;   // log2 of the largest SQ, in WQEBBs
    uint32_t max_cqe_log = 22;
    uint32_t log_max_msg = 30;
    uint32_t cqe_version = 1;
    bool atomic_fa64 = true;
    bool atomic_masked_fa32 = true;  // 4-byte extended atomics (needed for pyep's 32-bit signals)
    bool ib = false;                 // link layer InfiniBand (else Ethernet/RoCE)
};

// What one side tells the other at connect time (validated on receipt: see exchange code).
struct Address {
    uint64_t node_id = 0;   // softnic: fabric node id; DevX: 0
    uint16_t lid = 0;       // IB
    uint8_t gid[16] = {};   // RoCE / IB GRH
    uint8_t mac[6] = {};
    uint8_t port = 1;
    uint8_t gid_index = 0;
};

struct CqInfo {
    uint32_t cqn = 0;
    uint32_t log_size = 0;
    prm::Cqe64* cqes = nullptr;  // address the posting threads use
    uint32_t* dbrec = nullptr;
};

struct QpInfo {
    uint32_t qpn = 0;
    uint32_t log_sq = 0;
    uint8_t* sq = nullptr;
    uint32_t* dbrec = nullptr;
    uint8_t* bf = nullptr;      // doorbell register as the posting threads see it
    uint32_t bf_size = 0;
    uint32_t cqn = 0;
};

struct MrInfo {
    uint64_t addr = 0;
    uint64_t length = 0;
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    uint32_t access = 0;  // prm::Access bits
};

// INIT->RTR and RTR->RTS parameters. Defaults follow common NCCL_IB_* defaults.
struct ConnectAttr {
    uint32_t remote_qpn = 0;
    Address remote;
    uint32_t mtu = 4096;
    uint8_t sl = 0;
    uint8_t traffic_class = 0;
    uint16_t udp_sport = 0;       // RoCE v2 source port (ECMP entropy); 0 = provider picks per QP
    uint8_t retry_cnt = 7;
    uint8_t rnr_retry = 7;
    uint8_t ack_timeout = 20;     // 4.096 us * 2^timeout
    uint8_t min_rnr_timer = 12;
    uint32_t sq_psn = 0;
    uint32_t rq_psn = 0;
    uint8_t max_rd_atomic = 16;
};

class ProviderError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class Provider {
  public:
    virtual ~Provider() = default;
    virtual std::string kind() const = 0;  // "devx" or "softnic"
    virtual Caps query_caps() = 0;
    virtual Address local_address() = 0;
    virtual CqInfo create_cq(uint32_t log_size, Placement placement) = 0;
    virtual QpInfo create_qp(const CqInfo& cq, uint32_t log_sq, Placement placement) = 0;
    virtual void modify_qp_rst2init(uint32_t qpn, uint32_t access) = 0;
    virtual void modify_qp_init2rtr(uint32_t qpn, const ConnectAttr& attr) = 0;
    virtual void modify_qp_rtr2rts(uint32_t qpn, const ConnectAttr& attr) = 0;
    virtual void modify_qp_to_reset(uint32_t qpn) = 0;
    virtual void modify_qp_to_error(uint32_t qpn) = 0;
    virtual uint8_t query_qp_state(uint32_t qpn) = 0;  // prm::QpState
    virtual void destroy_qp(uint32_t qpn) = 0;
    virtual void destroy_cq(uint32_t cqn) = 0;
    virtual MrInfo reg_mr(void* addr, uint64_t length, uint32_t access) = 0;
    virtual void dereg_mr(uint32_t lkey) = 0;
};

// The device context GPU posters use for a QP built by a provider. Bookkeeping starts at zero: a QP
// that went through RESET starts its producer index again at 0 (PRM: reset clears the SQ counters).
inline gda::Qp make_qp_context(const QpInfo& qp, const CqInfo& cq) {
    gda::Qp ctx{};
    ctx.qpn = qp.qpn;
    ctx.log_sq = qp.log_sq;
    ctx.sq = qp.sq;
    ctx.dbrec = qp.dbrec;
    ctx.bf = qp.bf;
    ctx.bf_size = qp.bf_size;
    ctx.cq.cqes = cq.cqes;
    ctx.cq.dbrec = cq.dbrec;
    ctx.cq.log_size = cq.log_size;
    return ctx;
}

}  // namespace nic
}  // namespace pyep
