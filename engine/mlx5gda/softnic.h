// The softnic: a software mlx5 NIC that executes the send queues qp.h writes (transport="emulated").
//
// It is a nic::Provider like the DevX one, so the setup sequence (CQ, QP, RST->INIT->RTR->RTS, MRs,
// connect) is the same; what differs is who executes the WQEs: a progress thread per softnic notices
// doorbells by polling each QP's doorbell record, decodes the WQEs (wqe.h), checks them the way the
// requester and responder NICs would, moves the data (host memcpy/atomics, or CUDA copies/kernels for
// GPU memory) and writes real CQEs, including error CQEs with mlx5 syndromes and flush CQEs.
//
// Fabric: one softnic per process (or several in one process), one shared-memory segment per softnic
// publishing its MR table, QP states and drop rules, named after a random fabric id and the node id.
// A requester validates rkeys and the responder QP's state in the responder's segment, exactly the
// checks the responder NIC would make, then writes into the responder's memory directly (host memory
// the responder allocated with alloc_host() is shared memory; GPU memory is opened via CUDA IPC).
// The fabric is one host: ranks on different hosts need a real NIC.
#pragma once

#include <stdint.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx5gda/provider.h"

namespace pyep {
namespace softnic {

// Byte 54 of an error CQE. On real mlx5 the vendor syndrome is an opaque firmware code; the softnic
// uses it to say which of its checks failed (documented in docs/softnic.md).
enum VendorSyndrome : uint8_t {
    kVendNone = 0x00,
    kVendFlush = 0x01,          // WQE flushed because the QP is in error
    kVendQpNotRts = 0x10,       // doorbell rung while the QP was not in RTS
    kVendBadWqeIndex = 0x11,    // ctrl.wqe_index != expected producer index
    kVendBadQpn = 0x12,         // ctrl.qpn != this QP
    kVendBadDs = 0x13,          // ds does not fit the opcode
    kVendBadOpcode = 0x14,      // opcode / opmod the softnic does not execute
    kVendBadDoorbell = 0x15,    // doorbell counter ran ahead of the ring
    kVendLkey = 0x20,           // lkey unknown or invalidated
    kVendLbounds = 0x21,        // local address range outside the MR
    kVendLaccess = 0x22,        // local MR lacks LOCAL_WRITE (atomic fetch destination)
    kVendMsgLen = 0x23,         // message longer than 2^log_max_msg
    kVendFetchLen = 0x24,       // atomic fetch data segment length != operand size
    kVendRkey = 0x30,           // rkey unknown or invalidated at the responder
    kVendRbounds = 0x31,        // remote range outside the MR
    kVendRaccess = 0x32,        // remote MR lacks REMOTE_WRITE / REMOTE_ATOMIC
    kVendQpAccess = 0x33,       // responder QP not enabled for remote write / atomic (RST2INIT access)
    kVendAlign = 0x34,          // atomic target not naturally aligned
    kVendNotShareable = 0x35,   // responder memory lives in another process and is not shareable
    kVendRetry = 0x40,          // responder unreachable / not ready for the whole retry time
    kVendDropped = 0x41,        // injected drop (drop_peer) for the whole retry time
    kVendInjected = 0x50,       // injected failure (fail_after)
    kVendDma = 0x60,            // the CUDA copy / atomic failed
};

struct Options {
    uint64_t fabric_id = 0;        // 0: pick a random one (only useful for a single process)
    uint64_t node_id = 0;          // unique per softnic within a fabric
    uint32_t max_mrs = 1024;
    uint32_t max_qps = 1024;
    uint32_t idle_spin = 2000;     // empty passes before the progress thread starts sleeping
    uint32_t idle_sleep_us = 20;   // sleep between passes when idle
    int cuda_device = -1;          // CUDA build: device for streams/kernels; -1 = current device
};

struct QpStats {
    uint32_t qpn = 0;
    uint8_t state = 0;             // prm::QpState
    uint64_t remote_node = 0;
    uint32_t remote_qpn = 0;
    uint64_t wqes = 0;             // WQEs executed successfully (incl. NOPs)
    uint64_t bytes = 0;            // RDMA write payload bytes
    uint64_t atomics = 0;
    uint64_t errors = 0;           // error CQEs other than flushes
    uint64_t flushed = 0;          // WQEs completed with WR_FLUSH_ERR
    uint64_t cqes = 0;             // CQEs written for this QP
    uint64_t doorbells = 0;        // times the send DBR was seen to move
    uint64_t consumer_index = 0;   // WQEBBs fetched
    uint64_t pending = 0;          // executed, CQE not yet written (CUDA work in flight)
    uint8_t last_syndrome = 0;
    uint8_t last_vendor_syndrome = 0;
    uint16_t last_error_wqe = 0;
    std::string last_error;        // the last error, in words
};

struct CqStats {
    uint32_t cqn = 0;
    uint32_t log_size = 0;
    uint64_t producer_index = 0;   // CQEs written
    uint32_t consumer_index = 0;   // set_ci the poller last wrote (24 bits)
    bool overrun = false;          // the CQ is in error: more CQEs were due than it holds
    std::string error;
};

// What one softnic tells a peer at connect time; exchanged as a validated byte blob.
struct PeerInfo {
    uint64_t fabric_id = 0;
    uint64_t node_id = 0;
    uint64_t host_id = 0;
    uint32_t pid = 0;
    std::vector<uint32_t> qpns;
    std::vector<nic::MrInfo> mrs;
};

std::vector<uint8_t> encode_peer_info(const PeerInfo& info);
// Throws std::invalid_argument naming the problem (truncated, not a softnic blob, version, checksum,
// another fabric when expect_fabric != 0, another host).
PeerInfo decode_peer_info(const uint8_t* data, size_t size, uint64_t expect_fabric);
uint64_t this_host_id();

}  // namespace softnic

namespace nic {

class SoftNicProvider : public Provider {
  public:
    explicit SoftNicProvider(const softnic::Options& options);
    ~SoftNicProvider() override;
    SoftNicProvider(const SoftNicProvider&) = delete;
    SoftNicProvider& operator=(const SoftNicProvider&) = delete;

    // nic::Provider
    std::string kind() const override { return "softnic"; }
    Caps query_caps() override;
    Address local_address() override;
    CqInfo create_cq(uint32_t log_size, Placement placement) override;
    QpInfo create_qp(const CqInfo& cq, uint32_t log_sq, Placement placement) override;
    void modify_qp_rst2init(uint32_t qpn, uint32_t access) override;
    void modify_qp_init2rtr(uint32_t qpn, const ConnectAttr& attr) override;
    void modify_qp_rtr2rts(uint32_t qpn, const ConnectAttr& attr) override;
    void modify_qp_to_reset(uint32_t qpn) override;
    void modify_qp_to_error(uint32_t qpn) override;
    uint8_t query_qp_state(uint32_t qpn) override;
    void destroy_qp(uint32_t qpn) override;
    void destroy_cq(uint32_t cqn) override;
    MrInfo reg_mr(void* addr, uint64_t length, uint32_t access) override;
    void dereg_mr(uint32_t lkey) override;

    uint64_t fabric_id() const;
    uint64_t node_id() const;
    bool has_cuda() const;  // GPU memory can be registered (CUDA build with a usable device)

    // Host memory peers in other processes can access: shared memory owned by this softnic.
    void* alloc_host(uint64_t bytes);
    void free_host(void* ptr);

    // Progress: a thread, or explicit passes (only while the thread is stopped).
    void start();
    void stop();
    bool running() const;
    uint32_t progress_once();  // returns the amount of work done (WQEs fetched + CQEs written)

    // Fault injection. retry_ns < 0: use the requester QP's retry time (ack_timeout, retry_cnt).
    void drop_peer(uint64_t node, bool blackhole, int64_t retry_ns);
    void restore_peer(uint64_t node);
    void set_qp_delay(uint32_t qpn, uint64_t delay_ns);
    void set_peer_delay(uint64_t node, uint64_t delay_ns);
    void fail_after(uint32_t qpn, uint64_t n, uint8_t syndrome);
    void force_error(uint32_t qpn);
    void invalidate_key(uint32_t key);
    void clear_faults();

    // Diagnostics.
    softnic::QpStats qp_stats(uint32_t qpn);
    softnic::CqStats cq_stats(uint32_t cqn);
    std::vector<uint32_t> qpns();
    std::vector<std::string> drain_events();  // errors / overruns noticed since the last call

    softnic::PeerInfo peer_info(const std::vector<uint32_t>& qpns, const std::vector<MrInfo>& mrs);

    struct Impl;

  private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace nic
}  // namespace pyep
