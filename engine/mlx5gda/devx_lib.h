// The rdma-core entry points the DevX provider uses, resolved with dlopen/dlsym at run time.
//
// pyep must import (and work over NVLink/softnic) where rdma-core is absent, so nothing links against
// libibverbs/libmlx5. The headers are only used for the types and signatures. Entry points that older
// rdma-core releases lack (DMA-BUF, _ibv_query_gid_ex) are optional: their pointer stays null and the
// provider takes the fallback path.
#pragma once

#if defined(PYEP_HAVE_RDMA_CORE)

#include <dlfcn.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>

#include <string>

namespace pyep {
namespace nic {

struct RdmaLib {
    void* verbs_handle = nullptr;
    void* mlx5_handle = nullptr;
    std::string error;  // why loading failed ("" when loaded)

    // ibv_query_port/ibv_get_device_list/ibv_reg_mr are macros in verbs.h; these are the exported
    // functions behind them.
    decltype(&::ibv_get_device_list) get_device_list = nullptr;
    decltype(&::ibv_free_device_list) free_device_list = nullptr;
    decltype(&::ibv_get_device_name) get_device_name = nullptr;
    decltype(&::ibv_close_device) close_device = nullptr;
    decltype(&::ibv_alloc_pd) alloc_pd = nullptr;
    decltype(&::ibv_dealloc_pd) dealloc_pd = nullptr;
    decltype(&::ibv_query_port) query_port = nullptr;
    decltype(&::ibv_query_gid) query_gid = nullptr;
    decltype(&::_ibv_query_gid_ex) query_gid_ex = nullptr;  // optional
    decltype(&::ibv_reg_mr) reg_mr = nullptr;
    decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr = nullptr;  // optional
    decltype(&::ibv_dereg_mr) dereg_mr = nullptr;
    decltype(&::ibv_create_ah) create_ah = nullptr;
    decltype(&::ibv_destroy_ah) destroy_ah = nullptr;

    decltype(&::mlx5dv_is_supported) is_supported = nullptr;
    decltype(&::mlx5dv_open_device) open_device = nullptr;
    decltype(&::mlx5dv_init_obj) init_obj = nullptr;
    decltype(&::mlx5dv_devx_general_cmd) general_cmd = nullptr;
    decltype(&::mlx5dv_devx_obj_create) obj_create = nullptr;
    decltype(&::mlx5dv_devx_obj_modify) obj_modify = nullptr;
    decltype(&::mlx5dv_devx_obj_query) obj_query = nullptr;
    decltype(&::mlx5dv_devx_obj_destroy) obj_destroy = nullptr;
    decltype(&::mlx5dv_devx_umem_reg) umem_reg = nullptr;
    decltype(&::mlx5dv_devx_umem_reg_ex) umem_reg_ex = nullptr;  // optional (DMA-BUF UMEM)
    decltype(&::mlx5dv_devx_umem_dereg) umem_dereg = nullptr;
    decltype(&::mlx5dv_devx_alloc_uar) alloc_uar = nullptr;
    decltype(&::mlx5dv_devx_free_uar) free_uar = nullptr;
    decltype(&::mlx5dv_devx_query_eqn) query_eqn = nullptr;

    bool load() {
        verbs_handle = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!verbs_handle) {
            error = std::string("cannot load libibverbs.so.1 (install rdma-core / libibverbs1): ") + dlerror();
            return false;
        }
        mlx5_handle = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!mlx5_handle) {
            error = std::string("cannot load libmlx5.so.1 (install rdma-core's mlx5 provider, libmlx5-1): ") + dlerror();
            return false;
        }
        bool ok = true;
        auto sym = [&](void* h, const char* name, auto& fn, bool required) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
            if (!fn && required) {
                if (ok) error = std::string("rdma-core is too old: missing ") + name;
                ok = false;
            }
        };
        sym(verbs_handle, "ibv_get_device_list", get_device_list, true);
        sym(verbs_handle, "ibv_free_device_list", free_device_list, true);
        sym(verbs_handle, "ibv_get_device_name", get_device_name, true);
        sym(verbs_handle, "ibv_close_device", close_device, true);
        sym(verbs_handle, "ibv_alloc_pd", alloc_pd, true);
        sym(verbs_handle, "ibv_dealloc_pd", dealloc_pd, true);
        sym(verbs_handle, "ibv_query_port", query_port, true);
        sym(verbs_handle, "ibv_query_gid", query_gid, true);
        sym(verbs_handle, "_ibv_query_gid_ex", query_gid_ex, false);
        sym(verbs_handle, "ibv_reg_mr", reg_mr, true);
        sym(verbs_handle, "ibv_reg_dmabuf_mr", reg_dmabuf_mr, false);
        sym(verbs_handle, "ibv_dereg_mr", dereg_mr, true);
        sym(verbs_handle, "ibv_create_ah", create_ah, true);
        sym(verbs_handle, "ibv_destroy_ah", destroy_ah, true);
        sym(mlx5_handle, "mlx5dv_is_supported", is_supported, true);
        sym(mlx5_handle, "mlx5dv_open_device", open_device, true);
        sym(mlx5_handle, "mlx5dv_init_obj", init_obj, true);
        sym(mlx5_handle, "mlx5dv_devx_general_cmd", general_cmd, true);
        sym(mlx5_handle, "mlx5dv_devx_obj_create", obj_create, true);
        sym(mlx5_handle, "mlx5dv_devx_obj_modify", obj_modify, true);
        sym(mlx5_handle, "mlx5dv_devx_obj_query", obj_query, true);
        sym(mlx5_handle, "mlx5dv_devx_obj_destroy", obj_destroy, true);
        sym(mlx5_handle, "mlx5dv_devx_umem_reg", umem_reg, true);
        sym(mlx5_handle, "mlx5dv_devx_umem_reg_ex", umem_reg_ex, false);
        sym(mlx5_handle, "mlx5dv_devx_umem_dereg", umem_dereg, true);
        sym(mlx5_handle, "mlx5dv_devx_alloc_uar", alloc_uar, true);
        sym(mlx5_handle, "mlx5dv_devx_free_uar", free_uar, true);
        sym(mlx5_handle, "mlx5dv_devx_query_eqn", query_eqn, true);
        return ok;
    }
};

// One process-wide copy; dlopen is reference counted and the handles are never closed (unloading
// libibverbs while a device context exists would crash at exit).
inline const RdmaLib& rdma_lib() {
    static const RdmaLib lib = [] {
        RdmaLib l;
        l.load();
        return l;
    }();
    return lib;
}

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
