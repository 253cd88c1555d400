// The softnic fabric: shared-memory segments through which softnics in different processes see each
// other's MR tables, QP states and drop rules, and reach each other's host buffers.
//
// Each softnic owns one table segment "/pyep-sn-<fabric>-<node>" and one segment per alloc_host()
// buffer ("...-m<index>"). Only the owner writes its table; peers read it. Entries are published with a
// per-entry sequence lock (odd = being written) and copied word by word with atomic loads, so a reader
// in another process never acts on a half-written entry and there is no data race in the C++ sense.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

namespace pyep {
namespace softnic {

constexpr uint32_t kFabricVersion = 1;
constexpr uint32_t kMaxDropRules = 32;

// Where an MR's memory lives, which decides how a peer reaches it.
enum class MemKind : uint32_t {
    None = 0,
    HostPrivate = 1,  // ordinary process memory: only softnics of the same process can reach it
    HostShared = 2,   // inside an alloc_host() segment: peers map the segment
    Cuda = 3,         // GPU memory with a CUDA IPC handle
    CudaPrivate = 4,  // GPU memory without an IPC handle (e.g. VMM allocations): same process only
};

struct alignas(8) MrEntry {
    uint64_t seq;
    uint32_t key;
    uint32_t valid;        // 1 = registered and the key is usable
    uint32_t access;       // prm::Access
    uint32_t kind;         // MemKind
    uint64_t addr;
    uint64_t length;
    uint32_t seg_index;    // HostShared: which alloc_host segment
    int32_t device;        // Cuda: device ordinal of the owner
    uint64_t seg_offset;   // HostShared: addr - segment base; Cuda: addr - allocation base
    uint8_t ipc[64];       // Cuda: cudaIpcMemHandle_t of the allocation
    uint64_t reserved;
};
static_assert(sizeof(MrEntry) == 128, "MrEntry");

struct alignas(8) QpEntry {
    uint64_t seq;
    uint32_t qpn;
    uint32_t state;        // prm::QpState; 0 with qpn 0 = slot unused
    uint32_t access;       // RST2INIT access flags (remote write / atomic enable)
    uint32_t remote_qpn;
    uint64_t remote_node;
    uint64_t reserved[4];
};
static_assert(sizeof(QpEntry) == 64, "QpEntry");

struct alignas(8) DropRule {
    uint64_t node;
    uint32_t active;
    uint32_t blackhole;
    int64_t retry_ns;      // < 0: the requester QP's own retry time
    uint64_t reserved;
};

struct alignas(64) SegHeader {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t fabric_id;
    uint64_t node_id;
    uint64_t host_id;
    int32_t pid;
    uint32_t alive;        // 1 while the owner is up; cleared before it unmaps
    uint32_t max_mrs;
    uint32_t max_qps;
    uint64_t mr_offset;
    uint64_t qp_offset;
    uint64_t total_bytes;
    uint64_t drop_seq;     // sequence lock over drops[]
    DropRule drops[kMaxDropRules];
};

// A mapped POSIX shared-memory segment. The creator unlinks the name when it goes away; mappings
// peers already hold stay valid (the kernel keeps the memory until the last one is unmapped).
class ShmSegment {
  public:
    // Creates a new segment (fails if the name exists, unless the existing one is a stale softnic
    // table whose owner process is gone, which is then removed). Throws std::runtime_error.
    static std::unique_ptr<ShmSegment> create(const std::string& name, size_t bytes);
    // Maps an existing segment; nullptr if it does not exist.
    static std::unique_ptr<ShmSegment> open(const std::string& name);
    ~ShmSegment();
    ShmSegment(const ShmSegment&) = delete;
    ShmSegment& operator=(const ShmSegment&) = delete;

    void* base() const { return base_; }
    size_t size() const { return size_; }
    const std::string& name() const { return name_; }

  private:
    ShmSegment(std::string name, void* base, size_t size, bool owner)
        : name_(std::move(name)), base_(base), size_(size), owner_(owner) {}
    std::string name_;
    void* base_;
    size_t size_;
    bool owner_;
};

std::string table_segment_name(uint64_t fabric_id, uint64_t node_id);
std::string buffer_segment_name(uint64_t fabric_id, uint64_t node_id, uint32_t index);
size_t table_segment_bytes(uint32_t max_mrs, uint32_t max_qps);

// Initialises a freshly created table segment.
void init_table(void* base, uint64_t fabric_id, uint64_t node_id, uint32_t max_mrs, uint32_t max_qps);
// Checks that a mapped segment is a softnic table of this fabric/node; returns the reason if not.
std::string check_table(const void* base, size_t size, uint64_t fabric_id, uint64_t node_id);

inline MrEntry* mr_entries(void* base) {
    auto* h = static_cast<SegHeader*>(base);
    return reinterpret_cast<MrEntry*>(static_cast<uint8_t*>(base) + h->mr_offset);
}
inline QpEntry* qp_entries(void* base) {
    auto* h = static_cast<SegHeader*>(base);
    return reinterpret_cast<QpEntry*>(static_cast<uint8_t*>(base) + h->qp_offset);
}

// Sequence-locked publication. `bytes` covers the whole entry including its leading seq word.
void seq_publish(void* entry, const void* value, size_t bytes);
// Returns false if the entry stayed mid-write for the whole (bounded) retry loop.
bool seq_snapshot(const void* entry, void* out, size_t bytes);
// The drop rules of a table, consistently.
bool read_drop_rules(const SegHeader* h, DropRule* out);
void write_drop_rules(SegHeader* h, const DropRule* rules);

bool process_alive(int32_t pid);

}  // namespace softnic
}  // namespace pyep
