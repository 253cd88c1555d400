// DevxProvider: nic::Provider for a real ConnectX through rdma-core DevX (PRM commands from devx_cmd.h).
//
// libibverbs/libmlx5 are dlopen'ed when a provider is opened, never linked, so pyep imports on machines
// without rdma-core libraries; opening then fails with a ProviderError that says what is missing.
// Control memory (SQ ring, CQ ring, doorbell records) follows the requested Placement:
//   Device:     GPU memory registered as UMEM through DMA-BUF, else through peer memory (nvidia_peermem),
//               else host memory mapped into the GPU (each fallback logged with its reason);
//   HostMapped: host memory mapped into the GPU;   Host: plain host memory (CPU posters).
// For Device/HostMapped the QP's UAR page is mapped for the GPU with cudaHostRegister(IoMemory) so GPU
// threads ring doorbells directly. Everything CUDA is compiled only into CUDA builds (PYEP_WITH_CUDA);
// a host-only build supports Placement::Host only.
#pragma once

#if defined(PYEP_HAVE_RDMA_CORE)

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mlx5gda/devx_cmd.h"
#include "mlx5gda/provider.h"

namespace pyep {
namespace nic {

struct DevxOptions {
    std::string device_name;       // "mlx5_0"; required (selection happens in pyep.nic)
    uint8_t port = 1;
    int gid_index = -1;            // -1: RoCE v2 IPv4-mapped first, then other RoCE v2, then v1; IB: 0
    bool allow_dmabuf = true;      // UMEM/MR over DMA-BUF for GPU memory
    bool allow_peermem = true;     // UMEM/MR of GPU memory through nvidia_peermem
    bool allow_host_fallback = true;  // Device placement may fall back to host-mapped memory
    uint16_t udp_sport_base = 0xc000;  // per-QP RoCE v2 source ports are drawn from [base, 0xffff]
};

// level uses Python logging's numbers (10 debug, 20 info, 30 warning).
using LogFn = std::function<void(int level, const std::string& msg)>;

class DevxProvider : public Provider {
  public:
    explicit DevxProvider(const DevxOptions& opts, LogFn log = nullptr);
    ~DevxProvider() override;
    DevxProvider(const DevxProvider&) = delete;
    DevxProvider& operator=(const DevxProvider&) = delete;

    std::string kind() const override { return "devx"; }
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

    const devx::HcaCaps& hca_caps() const;
    uint32_t pdn() const;
    uint32_t active_mtu() const;   // bytes
    bool link_is_ib() const;
    // Where each CQ/QP's control memory actually ended up ("device/dmabuf", "device/peermem",
    // "host-mapped", "host"), keyed by "cq <n>" / "qp <n>".
    std::vector<std::pair<std::string, std::string>> placements() const;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// Names of the RDMA devices rdma-core sees, or a ProviderError saying why it cannot look.
std::vector<std::string> devx_device_names();
// "" when a DevxProvider for `device_name` can probably be opened here, else the reason it cannot.
std::string devx_unavailable_reason(const std::string& device_name);

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
