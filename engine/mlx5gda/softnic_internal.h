// Internal state of a softnic, shared by its control plane (softnic.cpp) and its engine
// (softnic_engine.cpp). Not part of the API.
#pragma once

#include <cstdio>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "mlx5gda/softnic.h"
#include "mlx5gda/softnic_fabric.h"
#include "mlx5gda/softnic_mem.h"
#include "mlx5gda/wqe.h"

namespace pyep {
namespace softnic {

constexpr uint32_t kQpnBase = 0x100;     // qpn = kQpnBase + table slot
constexpr uint32_t kBfHalfBytes = 256;   // BlueFlame buffer half, as on mlx5
constexpr uint32_t kFetchBudget = 256;   // WQEs one QP may fetch per pass (fairness between QPs)
constexpr size_t kMaxEvents = 256;

// Control memory (rings, CQs, doorbell records) as the softnic and the posters see it.
struct Allocation {
    uint8_t* host = nullptr;
    uint8_t* dev = nullptr;   // address posters use (== host unless CUDA host-mapped)
    size_t bytes = 0;
    bool cuda_mapped = false;
};

struct CqObj {
    uint32_t cqn = 0;
    uint32_t log_size = 0;
    Allocation ring;              // 2^log_size CQEs
    Allocation dbr;               // be32 set_ci, be32 arm
    uint64_t pi = 0;              // CQEs written
    bool overrun = false;
    std::string error;
    uint32_t users = 0;           // QPs attached
};

// A fetched WQE whose CQE (if any) is not written yet. Retired strictly in order.
struct Completion {
    uint16_t wqe_index = 0;
    uint8_t wqe_opcode = 0;
    bool signaled = false;
    bool error = false;
    uint8_t syndrome = 0;
    uint8_t vendor = 0;
    uint32_t byte_cnt = 0;
    bool cuda = false;            // work queued on the QP's stream
    void* event = nullptr;        // completes this entry and every CUDA entry before it
    void* copy_dst = nullptr;     // fetched value staged in the QP's scratch: copy here when retired
    uint32_t copy_slot = 0;
    uint32_t copy_size = 0;
};

struct QpObj {
    uint32_t qpn = 0;
    uint32_t slot = 0;
    uint32_t log_sq = 0;
    uint32_t cqn = 0;
    Allocation sq;
    Allocation db;                // DBR (8 bytes) then the BlueFlame page
    uint8_t state = prm::kQpsReset;
    uint32_t access = 0;
    uint64_t remote_node = 0;
    uint32_t remote_qpn = 0;
    uint64_t retry_ns = 0;        // 0 = infinite (ack_timeout 0)
    uint64_t ci = 0;              // WQEBBs fetched
    uint16_t last_dbr = 0;
    uint64_t head_seen_ns = 0;    // when the head WQE was first looked at (added delay)
    uint64_t head_retry_ns = 0;   // when the head WQE first failed to reach its responder
    std::deque<Completion> pending;
    bool cuda_unrecorded = false; // CUDA work queued since the last event
    // faults
    uint64_t delay_ns = 0;
    int64_t fail_after = -1;
    uint8_t fail_syndrome = 0;
    // CUDA resources (lazily)
    void* stream = nullptr;
    uint64_t* scratch = nullptr;  // pinned, one 8-byte slot per WQEBB, for fetched atomic values
    uint64_t* scratch_dev = nullptr;
    QpStats stats;
};

struct MrObj {
    nic::MrInfo info;
    MemKind kind = MemKind::None;
    bool valid = true;
    int device = -1;
    uint32_t seg_index = 0;
    uint64_t seg_offset = 0;
    uint8_t ipc[64] = {};
};

// What this softnic has mapped of a peer (including itself, via its own table).
struct PeerView {
    uint64_t node = 0;
    std::unique_ptr<ShmSegment> table;   // null for ourselves
    void* base = nullptr;
    int32_t pid = 0;
    bool alive = false;
    uint64_t checked_ns = 0;
    std::unordered_map<uint32_t, std::unique_ptr<ShmSegment>> buffers;
    std::map<std::string, void*> ipc;    // IPC handle bytes -> opened base
};

// A resolved memory range in this process's address space.
struct Span {
    uint8_t* ptr = nullptr;
    MemKind kind = MemKind::None;
    bool gpu() const { return kind == MemKind::Cuda || kind == MemKind::CudaPrivate; }
};

enum class Step { Done, Stall };

}  // namespace softnic

struct nic::SoftNicProvider::Impl {
    softnic::Options opt;
    uint64_t fabric_id = 0;
    uint64_t node_id = 0;
    std::unique_ptr<softnic::CudaBackend> cuda_owner;
    softnic::CudaBackend* cuda = nullptr;  // null: host-only build or no usable device
    int device = -1;

    std::unique_ptr<softnic::ShmSegment> table;
    softnic::SegHeader* hdr = nullptr;

    std::mutex mu;
    std::atomic<int> ctl_waiting{0};
    std::atomic<bool> running{false};
    std::thread thread;

    std::map<uint32_t, std::unique_ptr<softnic::CqObj>> cqs;
    uint32_t next_cqn = 1;
    std::map<uint32_t, std::unique_ptr<softnic::QpObj>> qps;
    std::vector<std::unique_ptr<softnic::MrObj>> mrs;   // by slot
    std::vector<uint8_t> mr_tags;
    std::vector<bool> qp_slot_used;
    std::map<uint32_t, std::unique_ptr<softnic::ShmSegment>> buffers;  // alloc_host, by index
    uint32_t next_buffer = 0;
    softnic::DropRule drops[softnic::kMaxDropRules] = {};
    std::map<uint64_t, uint64_t> peer_delay_ns;
    std::unordered_map<uint64_t, std::unique_ptr<softnic::PeerView>> peers;
    // IPC mappings of peers found dead by the engine thread, closed by the next control call
    // (cudaIpcCloseMemHandle may wait for running kernels, like the calls prepare_peer_cuda makes).
    std::vector<void*> retired_ipc;
    std::deque<std::string> events;
    std::vector<int> peer_access;          // devices this softnic's device has peer access to

    // control helpers (softnic.cpp)
    softnic::QpObj& qp(uint32_t qpn);
    softnic::CqObj& cq(uint32_t cqn);
    void publish_qp(const softnic::QpObj& q);
    void publish_mr(uint32_t slot);
    void set_state(softnic::QpObj& q, uint8_t state);
    void event(const std::string& text);
    softnic::Allocation alloc_control(size_t bytes, Placement placement, const char* what);
    void free_control(softnic::Allocation& a);
    void release_qp_cuda(softnic::QpObj& q);
    void clean_cq(const softnic::QpObj& q);

    // engine (softnic_engine.cpp)
    uint32_t pass();
    void thread_main();
    uint32_t service_qp(softnic::QpObj& q, uint64_t now);
    uint32_t retire(softnic::QpObj& q);
    bool write_cqe(softnic::CqObj& c, const gda::DecodedCqe& d);
    softnic::Step execute(softnic::QpObj& q, const uint8_t* wqe, uint64_t now);
    softnic::Step fail(softnic::QpObj& q, softnic::Completion c, uint8_t syndrome, uint8_t vendor,
                       const std::string& why);
    // `control`: a control call asking (probe now, and close what the engine retired); the engine
    // thread re-probes a peer, live or dead, at most every kPeerRecheckNs.
    softnic::PeerView* peer(uint64_t node, uint64_t now, bool control = false);
    void close_retired_ipc();
    void drop_peers_cache();
    // CUDA setup done from control calls, never lazily from the engine thread: cudaHostAlloc,
    // cudaIpcOpenMemHandle and peer enabling can wait for running kernels, and the kernels that are
    // running are the posters waiting on this very softnic (a deadlock until their timeout).
    void prepare_qp_cuda(softnic::QpObj& q);
    void prepare_peer_cuda(uint64_t node);
};

namespace softnic {

// Control calls take the engine lock between passes; `ctl_waiting` makes the progress thread step
// aside for them instead of re-taking the lock immediately.
class CtlLock {
  public:
    explicit CtlLock(nic::SoftNicProvider::Impl& m) : m_(m) {
        m_.ctl_waiting.fetch_add(1);
        lk_ = std::unique_lock<std::mutex>(m_.mu);
        m_.ctl_waiting.fetch_sub(1);
    }

  private:
    nic::SoftNicProvider::Impl& m_;
    std::unique_lock<std::mutex> lk_;
};

// snprintf, not iostreams: this runs on the softnic thread, and iostreams there crashed in builds whose
// compiler wrapper links its own libstdc++ copy (locale facets of two copies mixed).
inline std::string hex(uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%llx", (unsigned long long)v);
    return buf;
}

inline const char* state_name(uint32_t s) {
    switch (s) {
        case prm::kQpsReset: return "RESET";
        case prm::kQpsInit: return "INIT";
        case prm::kQpsRtr: return "RTR";
        case prm::kQpsRts: return "RTS";
        case prm::kQpsErr: return "ERR";
        default: return "unknown";
    }
}

}  // namespace softnic
}  // namespace pyep
