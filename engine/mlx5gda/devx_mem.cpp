// Control-memory placement and GPU doorbell mapping for the DevX provider (see devx_mem.h).
#if defined(PYEP_HAVE_RDMA_CORE)

#include "mlx5gda/devx_mem.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mlx5gda/prm.h"

#if defined(PYEP_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace pyep {
namespace nic {

namespace {

constexpr size_t kHostPage = 4096;
constexpr size_t kGpuPage = 64 * 1024;  // GPU memory is pinned for peers in 64 KiB pages

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
std::string errstr(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

#if defined(PYEP_WITH_CUDA)
std::string cuda_err(cudaError_t e) {
    return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e) + " (" + std::to_string((int)e) + ")";
}
std::string cu_err(CUresult r) {
    const char* name = nullptr;
    cuGetErrorName(r, &name);
    return std::string(name ? name : "CUDA_ERROR") + " (" + std::to_string((int)r) + ")";
}
#endif

}  // namespace

MemoryPlacer::MemoryPlacer(const RdmaLib& lib, ibv_context* ctx, ibv_pd* pd, const DevxOptions& opts,
                           const LogFn& log)
    : lib_(lib), ctx_(ctx), pd_(pd), opts_(opts), log_(log) {}

bool MemoryPlacer::umem_register(CtrlMem& m, std::string* why) {
    m.umem = lib_.umem_reg(ctx_, m.host ? m.host : m.poster, m.size, IBV_ACCESS_LOCAL_WRITE);
    if (!m.umem && why) *why = "mlx5dv_devx_umem_reg: " + errstr(errno);
    return m.umem != nullptr;
}

CtrlMem MemoryPlacer::alloc(size_t ring_bytes, Placement placement, const char* what) {
    CtrlMem m;
    m.dbr_offset = round_up(ring_bytes, 64);
    const size_t need = m.dbr_offset + 64;
    if (placement == Placement::Device) {
#if defined(PYEP_WITH_CUDA)
        m.size = round_up(need, kGpuPage);
        void* base = nullptr;
        cudaError_t ce = cudaMalloc(&base, m.size + kGpuPage);
        if (ce != cudaSuccess) throw ProviderError(std::string("cudaMalloc for ") + what + " rings: " + cuda_err(ce));
        m.alloc_base = base;
        m.kind = CtrlMem::CudaDevice;
        m.poster = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(base), kGpuPage));
        cudaMemset(m.poster, 0, m.size);
        std::string why_dmabuf = "disabled", why_peer = "disabled";
        if (opts_.allow_dmabuf) {
            if (!lib_.umem_reg_ex) {
                why_dmabuf = "rdma-core lacks mlx5dv_devx_umem_reg_ex";
            } else {
                int fd = -1;
                CUresult r = cuMemGetHandleForAddressRange(&fd, reinterpret_cast<CUdeviceptr>(m.poster), m.size,
                                                           CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
                if (r != CUDA_SUCCESS) {
                    why_dmabuf = "cuMemGetHandleForAddressRange: " + cu_err(r) +
                                 " (needs the open GPU kernel modules and Linux >= 5.12)";
                } else {
                    mlx5dv_devx_umem_in in{};
                    in.addr = nullptr;  // with a DMA-BUF fd this is the offset into it
                    in.size = m.size;
                    in.access = IBV_ACCESS_LOCAL_WRITE;
                    in.pgsz_bitmap = UINT64_MAX & ~(uint64_t)(kHostPage - 1);
                    in.comp_mask = MLX5DV_UMEM_MASK_DMABUF;
                    in.dmabuf_fd = fd;
                    m.umem = lib_.umem_reg_ex(ctx_, &in);
                    if (m.umem) {
                        m.dmabuf_fd = fd;
                        m.where = "device/dmabuf";
                        return m;
                    }
                    why_dmabuf = "mlx5dv_devx_umem_reg_ex(DMA-BUF): " + errstr(errno);
                    close(fd);
                }
            }
            say(20, std::string(what) + " rings: DMA-BUF registration unavailable (" + why_dmabuf +
                        "); trying peer memory");
        }
        if (opts_.allow_peermem) {
            if (umem_register(m, &why_peer)) {
                m.where = "device/peermem";
                return m;
            }
            why_peer += " (is nvidia_peermem loaded?)";
        }
        cudaFree(m.alloc_base);
        m = CtrlMem{};
        m.dbr_offset = round_up(ring_bytes, 64);
        const std::string reason = std::string("GPU memory for ") + what + " rings could not be registered with the NIC (DMA-BUF: " +
                                   why_dmabuf + "; peer memory: " + why_peer + ")";
        if (!opts_.allow_host_fallback) throw ProviderError(reason);
        say(30, reason + "; falling back to host memory mapped into the GPU (slower polling)");
        placement = Placement::HostMapped;
#else
        throw ProviderError("Placement::Device needs the CUDA build of pyep (this one is host-only)");
#endif
    }
    m.size = round_up(need, kHostPage);
    if (placement == Placement::HostMapped) {
#if defined(PYEP_WITH_CUDA)
        void* p = nullptr;
        cudaError_t ce = cudaHostAlloc(&p, m.size, cudaHostAllocMapped | cudaHostAllocPortable);
        if (ce != cudaSuccess) throw ProviderError(std::string("cudaHostAlloc for ") + what + " rings: " + cuda_err(ce));
        memset(p, 0, m.size);
        void* d = nullptr;
        ce = cudaHostGetDevicePointer(&d, p, 0);
        if (ce != cudaSuccess) {
            cudaFreeHost(p);
            throw ProviderError("cudaHostGetDevicePointer: " + cuda_err(ce));
        }
        m.kind = CtrlMem::CudaHostAlloc;
        m.alloc_base = p;
        m.host = static_cast<uint8_t*>(p);
        m.poster = static_cast<uint8_t*>(d);
        m.where = "host-mapped";
#else
        throw ProviderError("Placement::HostMapped needs the CUDA build of pyep (this one is host-only)");
#endif
    } else {
        void* p = nullptr;
        if (posix_memalign(&p, kHostPage, m.size)) throw ProviderError(std::string("out of memory for ") + what + " rings");
        memset(p, 0, m.size);
        m.kind = CtrlMem::HostAligned;
        m.alloc_base = p;
        m.host = m.poster = static_cast<uint8_t*>(p);
        m.where = "host";
    }
    std::string why;
    if (!umem_register(m, &why)) {
        free(m);
        throw ProviderError(std::string("registering ") + what + " rings as DevX UMEM: " + why +
                            " (check the memlock limit: ulimit -l unlimited)");
    }
    return m;
}

void MemoryPlacer::free(CtrlMem& m) {
    if (m.umem) lib_.umem_dereg(m.umem);
    m.umem = nullptr;
    if (m.dmabuf_fd >= 0) close(m.dmabuf_fd);
    m.dmabuf_fd = -1;
    switch (m.kind) {
        case CtrlMem::HostAligned: ::free(m.alloc_base); break;
#if defined(PYEP_WITH_CUDA)
        case CtrlMem::CudaHostAlloc: cudaFreeHost(m.alloc_base); break;
        case CtrlMem::CudaDevice: cudaFree(m.alloc_base); break;
#endif
        default: break;
    }
    m.kind = CtrlMem::None;
    m.alloc_base = nullptr;
}

void MemoryPlacer::init_cqes(CtrlMem& m, uint32_t n) {
    // Software owns a fresh ring: opcode INVALID, owner bit 1 (the poller expects owner 0 on pass 0).
    std::vector<uint8_t> img((size_t)n * prm::kCqeBytes, 0);
    for (uint32_t i = 0; i < n; ++i) img[(size_t)i * prm::kCqeBytes + 63] = (prm::kCqeInvalid << 4) | 1;
    if (m.host) {
        memcpy(m.host, img.data(), img.size());
        memset(m.host + m.dbr_offset, 0, 8);
        return;
    }
#if defined(PYEP_WITH_CUDA)
    cudaError_t ce = cudaMemcpy(m.poster, img.data(), img.size(), cudaMemcpyHostToDevice);
    if (ce == cudaSuccess) ce = cudaMemset(m.poster + m.dbr_offset, 0, 8);
    if (ce != cudaSuccess) throw ProviderError("initialising CQEs in GPU memory: " + cuda_err(ce));
#endif
}

MappedUar MemoryPlacer::alloc_uar(bool for_gpu) {
    MappedUar u;
    u.uar = lib_.alloc_uar(ctx_, MLX5DV_UAR_ALLOC_TYPE_BF);
    if (!u.uar) u.uar = lib_.alloc_uar(ctx_, MLX5DV_UAR_ALLOC_TYPE_NC);
    if (!u.uar) throw ProviderError("mlx5dv_devx_alloc_uar: " + errstr(errno));
    u.poster_reg = static_cast<uint8_t*>(u.uar->reg_addr);
    if (!for_gpu) return u;
#if defined(PYEP_WITH_CUDA)
    cudaError_t ce = cudaHostRegister(u.uar->base_addr, kHostPage,
                                      cudaHostRegisterIoMemory | cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (ce != cudaSuccess) {
        lib_.free_uar(u.uar);
        throw ProviderError(
            "mapping the NIC doorbell (UAR) page for the GPU failed: cudaHostRegister(IoMemory) returned " +
            cuda_err(ce) +
            ". GPU-initiated RDMA needs the NVIDIA driver option NVreg_RegistryDwords=\"PeerMappingOverride=1;\" "
            "(add `options nvidia NVreg_RegistryDwords=\"PeerMappingOverride=1;\"` to /etc/modprobe.d/nvidia.conf "
            "and reload the driver); `pyep doctor` checks it");
    }
    void* d = nullptr;
    ce = cudaHostGetDevicePointer(&d, u.uar->base_addr, 0);
    if (ce != cudaSuccess) {
        cudaHostUnregister(u.uar->base_addr);
        lib_.free_uar(u.uar);
        throw ProviderError("cudaHostGetDevicePointer(UAR): " + cuda_err(ce));
    }
    u.gpu_mapped = true;
    u.poster_reg = static_cast<uint8_t*>(d) +
                   (static_cast<uint8_t*>(u.uar->reg_addr) - static_cast<uint8_t*>(u.uar->base_addr));
    return u;
#else
    lib_.free_uar(u.uar);
    throw ProviderError("GPU doorbells need the CUDA build of pyep (this one is host-only)");
#endif
}

void MemoryPlacer::free_uar(MappedUar& u) {
    if (!u.uar) return;
#if defined(PYEP_WITH_CUDA)
    if (u.gpu_mapped) cudaHostUnregister(u.uar->base_addr);
#endif
    lib_.free_uar(u.uar);
    u = MappedUar{};
}

ibv_mr* MemoryPlacer::reg_mr(void* addr, uint64_t length, uint32_t access) {
    bool gpu = false;
#if defined(PYEP_WITH_CUDA)
    unsigned int mem_type = 0;
    if (cuPointerGetAttribute(&mem_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(addr)) ==
            CUDA_SUCCESS &&
        mem_type == CU_MEMORYTYPE_DEVICE) {
        gpu = true;
        std::string why = "disabled";
        if (opts_.allow_dmabuf && lib_.reg_dmabuf_mr) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
            const uintptr_t base = a & ~(uintptr_t)(kHostPage - 1);
            const size_t span = round_up(a + length, kHostPage) - base;
            int fd = -1;
            CUresult r = cuMemGetHandleForAddressRange(&fd, base, span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
            if (r == CUDA_SUCCESS) {
                ibv_mr* mr = lib_.reg_dmabuf_mr(pd_, a - base, length, a, fd, (int)access);
                const int e = errno;
                close(fd);
                if (mr) return mr;
                why = "ibv_reg_dmabuf_mr: " + errstr(e);
            } else {
                why = "cuMemGetHandleForAddressRange: " + cu_err(r);
            }
        } else if (opts_.allow_dmabuf) {
            why = "rdma-core lacks ibv_reg_dmabuf_mr";
        }
        say(20, "GPU memory region: DMA-BUF registration unavailable (" + why + "); trying ibv_reg_mr (peer memory)");
    }
#endif
    ibv_mr* mr = lib_.reg_mr(pd_, addr, length, (int)access);
    if (!mr) {
        const int e = errno;
        throw ProviderError("ibv_reg_mr of " + std::to_string(length) + " bytes failed: " + errstr(e) +
                            (gpu ? " (GPU memory needs nvidia_peermem or DMA-BUF support; see `pyep doctor`)"
                                 : " (check the memlock limit: ulimit -l unlimited)"));
    }
    return mr;
}

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
