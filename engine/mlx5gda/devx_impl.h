// DevxProvider's private state, shared by devx_provider.cpp (objects, transitions) and devx_open.cpp
// (device, port, GID and capability discovery). Not part of the engine's interface.
#pragma once

#if defined(PYEP_HAVE_RDMA_CORE)

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "mlx5gda/devx_cmd.h"
#include "mlx5gda/devx_lib.h"
#include "mlx5gda/devx_mem.h"
#include "mlx5gda/devx_provider.h"

namespace pyep {
namespace nic {

std::string errstr(int e);
// "<what> failed: <errno>; firmware status <NAME>, syndrome 0x..." from a command's output mailbox.
std::string cmd_error(const char* what, int ret, const devx::Bytes& out);
std::string device_list_error(int e);

struct DevxProvider::Impl {
    const RdmaLib& lib = rdma_lib();
    DevxOptions opts;
    LogFn log;
    std::mutex mu;
    ibv_context* ctx = nullptr;
    ibv_pd* pd = nullptr;
    uint32_t pdn = 0;
    ibv_port_attr port{};
    int gid_index = 0;
    uint8_t gid[16] = {};
    uint8_t mac[6] = {};
    devx::HcaCaps caps;
    mlx5dv_devx_uar* cq_uar = nullptr;
    uint32_t eqn = 0;
    std::unique_ptr<MemoryPlacer> placer;

    struct Cq {
        mlx5dv_devx_obj* obj = nullptr;
        CtrlMem mem;
        uint32_t log_size = 0;
    };
    struct Qp {
        mlx5dv_devx_obj* obj = nullptr;
        CtrlMem mem;
        MappedUar uar;
        uint32_t cqn = 0;
    };
    std::map<uint32_t, Cq> cqs;
    std::map<uint32_t, Qp> qps;
    std::map<uint32_t, ibv_mr*> mrs;

    void say(int level, const std::string& m) const {
        if (log) log(level, m);
    }
    bool roce() const { return port.link_layer == IBV_LINK_LAYER_ETHERNET; }

    void open();
    void select_gid();
    void query_caps();
    void teardown();
    Qp& qp_or_throw(uint32_t qpn) {
        auto it = qps.find(qpn);
        if (it == qps.end()) throw ProviderError("no QP " + std::to_string(qpn) + " on " + opts.device_name);
        return it->second;
    }
    void modify(uint32_t qpn, const devx::Bytes& in, const char* what) {
        Qp& qp = qp_or_throw(qpn);
        devx::Bytes out(devx::kCmdOutHdrBytes, 0);
        const int ret = lib.obj_modify(qp.obj, in.data(), in.size(), out.data(), out.size());
        if (ret) throw ProviderError(cmd_error(what, ret, out) + " on QP " + std::to_string(qpn) + " of " + opts.device_name);
    }
};

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
