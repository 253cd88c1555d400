// Control memory and UAR mapping for the DevX provider: where SQ/CQ rings and doorbell records live,
// how the NIC gets at them (DevX UMEM), and how GPU threads reach the doorbell register.
#pragma once

#if defined(PYEP_HAVE_RDMA_CORE)

#include <string>

#include "mlx5gda/devx_lib.h"
#include "mlx5gda/devx_provider.h"

namespace pyep {
namespace nic {

struct CtrlMem {
    uint8_t* poster = nullptr;       // address posting threads use (device or host)
    uint8_t* host = nullptr;         // host address when the memory is host memory, else null
    void* alloc_base = nullptr;      // what to free
    size_t size = 0;                 // bytes registered (ring + doorbell record, page rounded)
    size_t dbr_offset = 0;           // doorbell record offset inside the block
    mlx5dv_devx_umem* umem = nullptr;
    int dmabuf_fd = -1;
    enum Kind { None, HostAligned, CudaHostAlloc, CudaDevice } kind = None;
    std::string where;               // "device/dmabuf", "device/peermem", "host-mapped", "host"
};

struct MappedUar {
    mlx5dv_devx_uar* uar = nullptr;
    uint8_t* poster_reg = nullptr;   // BlueFlame register as the posting threads address it
    bool gpu_mapped = false;         // cudaHostRegister'ed: unregister on free
};

class MemoryPlacer {
  public:
    MemoryPlacer(const RdmaLib& lib, ibv_context* ctx, ibv_pd* pd, const DevxOptions& opts, const LogFn& log);

    // `ring_bytes` of ring followed by a 64-byte-aligned doorbell record, registered as one UMEM.
    // Device placement degrades to host-mapped (logged) when no GPU UMEM path works.
    CtrlMem alloc(size_t ring_bytes, Placement placement, const char* what);
    void free(CtrlMem& m);
    // Pre-sets every CQE to INVALID with owner bit 1 and clears the doorbell record.
    void init_cqes(CtrlMem& m, uint32_t n);

    MappedUar alloc_uar(bool for_gpu);
    void free_uar(MappedUar& u);

    // Data memory: GPU memory through DMA-BUF first, then ibv_reg_mr (host memory, or GPU memory via
    // nvidia_peermem). Fallbacks are logged with their reason.
    ibv_mr* reg_mr(void* addr, uint64_t length, uint32_t access);

  private:
    bool umem_register(CtrlMem& m, std::string* why);
    void say(int level, const std::string& msg) const {
        if (log_) log_(level, msg);
    }
    const RdmaLib& lib_;
    ibv_context* ctx_;
    ibv_pd* pd_;
    DevxOptions opts_;
    LogFn log_;
};

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
