// Shared-memory segments, sequence-locked tables and the connect blob of the softnic fabric.
#include "mlx5gda/softnic_fabric.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "mlx5gda/softnic.h"

namespace {
std::string hex_id(uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%llx", (unsigned long long)v);
    return buf;
}
}  // namespace

namespace pyep {
namespace softnic {

namespace {

constexpr char kTableMagic[8] = {'P', 'Y', 'E', 'P', 'S', 'N', 'T', '1'};
constexpr char kBlobMagic[8] = {'P', 'Y', 'E', 'P', 'S', 'N', 'C', '1'};
constexpr uint32_t kBlobVersion = 1;
constexpr uint32_t kMaxBlobQpns = 1u << 16;
constexpr uint32_t kMaxBlobMrs = 1u << 12;

std::string errno_text(const char* what, const std::string& name) {
    return std::string(what) + " " + name + ": " + std::strerror(errno);
}

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Atomic word copies: the peer writing the entry may be another process.
void copy_words_relaxed(uint64_t* dst, const uint64_t* src, size_t words) {
    for (size_t i = 0; i < words; ++i) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}
void store_words_relaxed(uint64_t* dst, const uint64_t* src, size_t words) {
    for (size_t i = 0; i < words; ++i) __atomic_store_n(&dst[i], src[i], __ATOMIC_RELAXED);
}

uint32_t crc32(const uint8_t* p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
    const size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
}

struct Reader {
    const uint8_t* p;
    size_t n, at = 0;
    template <typename T>
    T get(const char* field) {
        if (at + sizeof(T) > n)
            throw std::invalid_argument(std::string("softnic connect blob truncated (reading ") + field + ")");
        T v;
        std::memcpy(&v, p + at, sizeof(T));
        at += sizeof(T);
        return v;
    }
};

}  // namespace

std::unique_ptr<ShmSegment> ShmSegment::create(const std::string& name, size_t bytes) {
    for (int attempt = 0; attempt < 2; ++attempt) {
        const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0 && errno == EEXIST && attempt == 0) {
            // A segment of this name survives only if its owner died without cleaning up, or the
            // node id is in use. Tables say which; buffer names are derived from a table we now own.
            std::unique_ptr<ShmSegment> old = open(name);
            if (old && old->size() >= sizeof(SegHeader) &&
                std::memcmp(static_cast<SegHeader*>(old->base())->magic, kTableMagic, 8) == 0) {
                const auto* h = static_cast<const SegHeader*>(old->base());
                const int32_t pid = __atomic_load_n(&h->pid, __ATOMIC_ACQUIRE);
                if (__atomic_load_n(&h->alive, __ATOMIC_ACQUIRE) && process_alive(pid)) {
                    const std::string msg = "softnic node " + std::to_string(h->node_id) +
                                            " already exists in fabric " + hex_id(h->fabric_id) + " (process " +
                                            std::to_string(pid) + " owns " + name +
                                            "): node ids must be unique per fabric";
                    throw std::runtime_error(msg);
                }
            }
            shm_unlink(name.c_str());
            continue;
        }
        if (fd < 0) throw std::runtime_error(errno_text("shm_open(create)", name));
        if (ftruncate(fd, (off_t)bytes) != 0) {
            const std::string msg = errno_text("ftruncate", name);
            close(fd);
            shm_unlink(name.c_str());
            throw std::runtime_error(msg);
        }
        void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (base == MAP_FAILED) {
            const std::string msg = errno_text("mmap", name);
            shm_unlink(name.c_str());
            throw std::runtime_error(msg);
        }
        return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, bytes, true));
    }
    throw std::runtime_error("shm segment " + name + " exists and could not be replaced");
}

std::unique_ptr<ShmSegment> ShmSegment::open(const std::string& name) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return nullptr;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
        close(fd);
        return nullptr;
    }
    void* base = mmap(nullptr, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return nullptr;
    return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, (size_t)st.st_size, false));
}

ShmSegment::~ShmSegment() {
    munmap(base_, size_);
    if (owner_) shm_unlink(name_.c_str());
}

std::string table_segment_name(uint64_t fabric_id, uint64_t node_id) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "/pyep-sn-%016llx-%llx", (unsigned long long)fabric_id,
                  (unsigned long long)node_id);
    return buf;
}

std::string buffer_segment_name(uint64_t fabric_id, uint64_t node_id, uint32_t index) {
    return table_segment_name(fabric_id, node_id) + "-m" + std::to_string(index);
}

size_t table_segment_bytes(uint32_t max_mrs, uint32_t max_qps) {
    return round_up(sizeof(SegHeader), 128) + (size_t)max_mrs * sizeof(MrEntry) + (size_t)max_qps * sizeof(QpEntry);
}

void init_table(void* base, uint64_t fabric_id, uint64_t node_id, uint32_t max_mrs, uint32_t max_qps) {
    const size_t bytes = table_segment_bytes(max_mrs, max_qps);
    std::memset(base, 0, bytes);
    auto* h = static_cast<SegHeader*>(base);
    h->version = kFabricVersion;
    h->header_bytes = sizeof(SegHeader);
    h->fabric_id = fabric_id;
    h->node_id = node_id;
    h->host_id = this_host_id();
    h->pid = (int32_t)getpid();
    h->max_mrs = max_mrs;
    h->max_qps = max_qps;
    h->mr_offset = round_up(sizeof(SegHeader), 128);
    h->qp_offset = h->mr_offset + (uint64_t)max_mrs * sizeof(MrEntry);
    h->total_bytes = bytes;
    // The magic goes last: a peer that maps the segment mid-initialisation sees "not a table yet".
    __atomic_store_n(&h->alive, 1u, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    std::memcpy(h->magic, kTableMagic, 8);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

std::string check_table(const void* base, size_t size, uint64_t fabric_id, uint64_t node_id) {
    if (size < sizeof(SegHeader)) return "segment too small for a softnic table";
    const auto* h = static_cast<const SegHeader*>(base);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (std::memcmp(h->magic, kTableMagic, 8) != 0) return "not a softnic table (or still being created)";
    if (h->version != kFabricVersion) return "softnic table version " + std::to_string(h->version) +
                                             ", this build speaks " + std::to_string(kFabricVersion);
    if (h->fabric_id != fabric_id || h->node_id != node_id) return "table belongs to another fabric/node";
    if (h->total_bytes > size || h->qp_offset + (uint64_t)h->max_qps * sizeof(QpEntry) > size ||
        h->mr_offset + (uint64_t)h->max_mrs * sizeof(MrEntry) > h->qp_offset)
        return "softnic table layout inconsistent with its size";
    return "";
}

void seq_publish(void* entry, const void* value, size_t bytes) {
    auto* dst = static_cast<uint64_t*>(entry);
    const auto* src = static_cast<const uint64_t*>(value);
    const uint64_t s = __atomic_load_n(&dst[0], __ATOMIC_RELAXED);
    __atomic_store_n(&dst[0], s + 1, __ATOMIC_RELAXED);  // odd: readers retry
    __atomic_thread_fence(__ATOMIC_RELEASE);
    store_words_relaxed(dst + 1, src + 1, bytes / 8 - 1);
    __atomic_store_n(&dst[0], s + 2, __ATOMIC_RELEASE);
}

bool seq_snapshot(const void* entry, void* out, size_t bytes) {
    const auto* src = static_cast<const uint64_t*>(entry);
    auto* dst = static_cast<uint64_t*>(out);
    // The writer holds the entry for a few dozen stores; 10^5 tries only fail if it died mid-write.
    for (int tries = 0; tries < 100000; ++tries) {
        const uint64_t s1 = __atomic_load_n(&src[0], __ATOMIC_ACQUIRE);
        if (s1 & 1) continue;
        copy_words_relaxed(dst + 1, src + 1, bytes / 8 - 1);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&src[0], __ATOMIC_RELAXED) == s1) {
            dst[0] = s1;
            return true;
        }
    }
    return false;
}

bool read_drop_rules(const SegHeader* h, DropRule* out) {
    for (int tries = 0; tries < 100000; ++tries) {
        const uint64_t s1 = __atomic_load_n(&h->drop_seq, __ATOMIC_ACQUIRE);
        if (s1 & 1) continue;
        copy_words_relaxed(reinterpret_cast<uint64_t*>(out), reinterpret_cast<const uint64_t*>(h->drops),
                           sizeof(h->drops) / 8);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&h->drop_seq, __ATOMIC_RELAXED) == s1) return true;
    }
    return false;
}

void write_drop_rules(SegHeader* h, const DropRule* rules) {
    const uint64_t s = __atomic_load_n(&h->drop_seq, __ATOMIC_RELAXED);
    __atomic_store_n(&h->drop_seq, s + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    store_words_relaxed(reinterpret_cast<uint64_t*>(h->drops), reinterpret_cast<const uint64_t*>(rules),
                        sizeof(h->drops) / 8);
    __atomic_store_n(&h->drop_seq, s + 2, __ATOMIC_RELEASE);
}

bool process_alive(int32_t pid) {
    if (pid <= 0) return false;
    return kill(pid, 0) == 0 || errno == EPERM;
}

uint64_t this_host_id() {
    // Shared memory only connects processes of one running kernel: hostname + boot id identify it.
    std::string ident;
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    ident += host;
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string line;
    if (boot && std::getline(boot, line)) ident += "/" + line;
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (unsigned char c : ident) h = (h ^ c) * 1099511628211ull;
    return h;
}

std::vector<uint8_t> encode_peer_info(const PeerInfo& info) {
    if (info.qpns.size() > kMaxBlobQpns || info.mrs.size() > kMaxBlobMrs)
        throw std::invalid_argument("too many QPs or MRs for one softnic connect blob");
    std::vector<uint8_t> out(kBlobMagic, kBlobMagic + 8);
    put<uint32_t>(out, kBlobVersion);
    put<uint32_t>(out, 0);  // total length, patched below
    put<uint64_t>(out, info.fabric_id);
    put<uint64_t>(out, info.node_id);
    put<uint64_t>(out, info.host_id);
    put<uint32_t>(out, info.pid);
    put<uint32_t>(out, (uint32_t)info.qpns.size());
    put<uint32_t>(out, (uint32_t)info.mrs.size());
    put<uint32_t>(out, 0);
    for (uint32_t q : info.qpns) put<uint32_t>(out, q);
    for (const auto& mr : info.mrs) {
        put<uint64_t>(out, mr.addr);
        put<uint64_t>(out, mr.length);
        put<uint32_t>(out, mr.rkey);
        put<uint32_t>(out, mr.access);
    }
    const uint32_t total = (uint32_t)out.size() + 4;
    std::memcpy(out.data() + 12, &total, 4);
    put<uint32_t>(out, crc32(out.data(), out.size()));
    return out;
}

PeerInfo decode_peer_info(const uint8_t* data, size_t size, uint64_t expect_fabric) {
    if (size < 8 || std::memcmp(data, kBlobMagic, 8) != 0)
        throw std::invalid_argument("not a softnic connect blob (bad magic; expected one made by "
                                    "SoftNic.connect_blob)");
    Reader r{data, size, 8};
    const uint32_t version = r.get<uint32_t>("version");
    if (version != kBlobVersion)
        throw std::invalid_argument("softnic connect blob version " + std::to_string(version) +
                                    ", this build reads version " + std::to_string(kBlobVersion));
    const uint32_t total = r.get<uint32_t>("length");
    if (total != size)
        throw std::invalid_argument("softnic connect blob length " + std::to_string(size) + " != encoded " +
                                    std::to_string(total) + " (truncated or padded)");
    uint32_t crc;
    std::memcpy(&crc, data + size - 4, 4);
    if (crc32(data, size - 4) != crc) throw std::invalid_argument("softnic connect blob checksum mismatch (corrupted)");
    PeerInfo info;
    info.fabric_id = r.get<uint64_t>("fabric_id");
    info.node_id = r.get<uint64_t>("node_id");
    info.host_id = r.get<uint64_t>("host_id");
    info.pid = r.get<uint32_t>("pid");
    const uint32_t nq = r.get<uint32_t>("qp count");
    const uint32_t nm = r.get<uint32_t>("mr count");
    r.get<uint32_t>("reserved");
    if (nq > kMaxBlobQpns || nm > kMaxBlobMrs) throw std::invalid_argument("softnic connect blob: implausible counts");
    for (uint32_t i = 0; i < nq; ++i) info.qpns.push_back(r.get<uint32_t>("qpn"));
    for (uint32_t i = 0; i < nm; ++i) {
        nic::MrInfo mr;
        mr.addr = r.get<uint64_t>("mr addr");
        mr.length = r.get<uint64_t>("mr length");
        mr.rkey = r.get<uint32_t>("mr rkey");
        mr.access = r.get<uint32_t>("mr access");
        info.mrs.push_back(mr);
    }
    if (r.at + 4 != size) throw std::invalid_argument("softnic connect blob has trailing bytes");
    if (expect_fabric != 0 && info.fabric_id != expect_fabric) {
        const std::string msg = "softnic connect blob from fabric " + hex_id(info.fabric_id) + ", expected " +
                                hex_id(expect_fabric) + " (a blob from another job or a stale store?)";
        throw std::invalid_argument(msg);
    }
    if (info.host_id != this_host_id())
        throw std::invalid_argument("softnic connect blob from node " + std::to_string(info.node_id) +
                                    " on another host: the softnic fabric spans one host (use a real NIC "
                                    "between hosts)");
    return info;
}

}  // namespace softnic
}  // namespace pyep
