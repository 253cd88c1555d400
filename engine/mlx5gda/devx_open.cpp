// DevxProvider: opening the device (DevX context, PD/pdn, port, GID selection, HCA capabilities) and
// the device-listing helpers used by diagnostics.
#if defined(PYEP_HAVE_RDMA_CORE)

#include <net/if.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "mlx5gda/devx_impl.h"

namespace pyep {
namespace nic {

std::string errstr(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

std::string cmd_error(const char* what, int ret, const devx::Bytes& out) {
    std::string msg = std::string(what) + " failed: " + errstr(ret ? (ret < 0 ? -ret : ret) : errno);
    const devx::CmdStatus st = devx::parse_status(out.data(), out.size());
    if (st.status) {
        msg += "; firmware status " + devx::status_name(st.status) + ", syndrome 0x";
        char buf[16];
        snprintf(buf, sizeof buf, "%08x", st.syndrome);
        msg += buf;
    }
    return msg;
}

std::string device_list_error(int e) {
    std::string m = "ibv_get_device_list failed: " + errstr(e);
    if (e == ENOSYS) m += ": the kernel has no RDMA support loaded (ib_uverbs/mlx5_ib absent), so there is no NIC path";
    return m;
}

namespace {

bool ipv4_mapped(const uint8_t* g) {
    for (int i = 0; i < 10; ++i)
        if (g[i]) return false;
    return g[10] == 0xff && g[11] == 0xff;
}

bool zero_gid(const uint8_t* g) {
    for (int i = 0; i < 16; ++i)
        if (g[i]) return false;
    return true;
}

std::string read_first_line(const std::string& path) {
    std::ifstream f(path);
    std::string s;
    std::getline(f, s);
    return s;
}

}  // namespace

void DevxProvider::Impl::open() {
    if (!lib.error.empty()) throw ProviderError("DevX provider unavailable: " + lib.error);
    int n = 0;
    ibv_device** list = lib.get_device_list(&n);
    if (!list) throw ProviderError(device_list_error(errno));
    ibv_device* dev = nullptr;
    std::string names;
    for (int i = 0; i < n; ++i) {
        const std::string name = lib.get_device_name(list[i]);
        names += (names.empty() ? "" : ", ") + name;
        if (name == opts.device_name) dev = list[i];
    }
    if (!dev) {
        lib.free_device_list(list);
        throw ProviderError("RDMA device '" + opts.device_name + "' not found (rdma-core sees: " +
                            (names.empty() ? std::string("none") : names) + ")");
    }
    if (!lib.is_supported(dev)) {
        lib.free_device_list(list);
        throw ProviderError(opts.device_name + " is not an mlx5 device: the DevX provider needs a ConnectX (mlx5)");
    }
    mlx5dv_context_attr attr{};
    attr.flags = MLX5DV_CONTEXT_FLAGS_DEVX;
    ctx = lib.open_device(dev, &attr);
    const int open_errno = errno;
    lib.free_device_list(list);
    if (!ctx) {
        throw ProviderError("mlx5dv_open_device(" + opts.device_name + ", DEVX) failed: " + errstr(open_errno) +
                            ". DevX needs read/write access to /dev/infiniband/uverbs* and a kernel/firmware with "
                            "DevX (mlx5_ib); see `pyep doctor`");
    }
    pd = lib.alloc_pd(ctx);
    if (!pd) throw ProviderError("ibv_alloc_pd failed on " + opts.device_name + ": " + errstr(errno));
    mlx5dv_pd dvpd{};
    mlx5dv_obj obj{};
    obj.pd.in = pd;
    obj.pd.out = &dvpd;
    if (lib.init_obj(&obj, MLX5DV_OBJ_PD)) throw ProviderError("mlx5dv_init_obj(PD) failed: " + errstr(errno));
    pdn = dvpd.pdn;
    if (lib.query_port(ctx, opts.port, reinterpret_cast<_compat_ibv_port_attr*>(&port))) {
        throw ProviderError("ibv_query_port(" + opts.device_name + ", port " + std::to_string(opts.port) +
                            ") failed: " + errstr(errno));
    }
    if (port.state != IBV_PORT_ACTIVE) {
        throw ProviderError(opts.device_name + " port " + std::to_string(opts.port) + " is not ACTIVE (state " +
                            std::to_string(port.state) + "): check the cable/switch and `ibstat`");
    }
    select_gid();
    query_caps();
    if (lib.query_eqn(ctx, 0, &eqn)) throw ProviderError("mlx5dv_devx_query_eqn failed: " + errstr(errno));
    cq_uar = lib.alloc_uar(ctx, MLX5DV_UAR_ALLOC_TYPE_NC);
    if (!cq_uar) cq_uar = lib.alloc_uar(ctx, MLX5DV_UAR_ALLOC_TYPE_BF);
    if (!cq_uar) throw ProviderError("mlx5dv_devx_alloc_uar failed: " + errstr(errno));
    placer = std::make_unique<MemoryPlacer>(lib, ctx, pd, opts, log);
    say(20, "opened " + opts.device_name + " port " + std::to_string(opts.port) + " (" +
                (roce() ? "RoCE" : "InfiniBand") + ", pdn " + std::to_string(pdn) + ", gid index " +
                std::to_string(gid_index) + ")");
}

void DevxProvider::Impl::select_gid() {
    if (!roce() && opts.gid_index < 0) {
        gid_index = 0;  // IB: the port GID; QPs inside one subnet route by LID anyway
    } else if (opts.gid_index >= 0) {
        gid_index = opts.gid_index;
    } else {
        // RoCE v2 with an IPv4-mapped address first (routable, what switches' ECMP hashes on), then
        // global then link-local IPv6 RoCE v2 GIDs, then RoCE v1. pyep/nic/select.py ranks the same way.
        int best = -1, best_rank = 99;
        for (int i = 0; i < port.gid_tbl_len; ++i) {
            uint8_t g[16];
            int type = -1;
            if (lib.query_gid_ex) {
                ibv_gid_entry e{};
                if (lib.query_gid_ex(ctx, opts.port, i, &e, 0, sizeof e)) continue;
                memcpy(g, e.gid.raw, 16);
                type = (int)e.gid_type;
            } else {
                ibv_gid gg{};
                if (lib.query_gid(ctx, opts.port, i, &gg)) continue;
                memcpy(g, gg.raw, 16);
                const std::string t = read_first_line("/sys/class/infiniband/" + opts.device_name + "/ports/" +
                                                      std::to_string(opts.port) + "/gid_attrs/types/" +
                                                      std::to_string(i));
                type = t == "RoCE v2" ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1;
            }
            if (zero_gid(g)) continue;
            const bool link_local = g[0] == 0xfe && (g[1] & 0xc0) == 0x80;
            const int rank = type == IBV_GID_TYPE_ROCE_V2 ? (ipv4_mapped(g) ? 0 : link_local ? 2 : 1) : 3;
            if (rank < best_rank) best_rank = rank, best = i;
        }
        if (best < 0) {
            throw ProviderError(opts.device_name + " port " + std::to_string(opts.port) +
                                " has no usable RoCE GID: give the interface an IP address, or set gid_index");
        }
        gid_index = best;
    }
    ibv_gid g{};
    if (lib.query_gid(ctx, opts.port, gid_index, &g)) {
        throw ProviderError("ibv_query_gid(" + opts.device_name + ", index " + std::to_string(gid_index) +
                            ") failed: " + errstr(errno));
    }
    memcpy(gid, g.raw, 16);
    if (roce() && lib.query_gid_ex) {
        ibv_gid_entry e{};
        char ifname[IF_NAMESIZE] = {};
        if (!lib.query_gid_ex(ctx, opts.port, gid_index, &e, 0, sizeof e) && e.ndev_ifindex &&
            if_indextoname(e.ndev_ifindex, ifname)) {
            const std::string m = read_first_line(std::string("/sys/class/net/") + ifname + "/address");
            unsigned v[6];
            if (sscanf(m.c_str(), "%x:%x:%x:%x:%x:%x", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]) == 6)
                for (int i = 0; i < 6; ++i) mac[i] = (uint8_t)v[i];
        }
    }
}

void DevxProvider::Impl::query_caps() {
    auto query = [&](uint16_t type, devx::Bytes& out) -> int {
        const devx::Bytes in = devx::encode_query_hca_cap(type, true);
        out.assign(devx::kQueryHcaCapOutBytes, 0);
        return lib.general_cmd(ctx, in.data(), in.size(), out.data(), out.size());
    };
    devx::Bytes general, atomic;
    int ret = query(devx::kCapTypeGeneral, general);
    if (ret) throw ProviderError(cmd_error("QUERY_HCA_CAP(general)", ret, general));
    caps = devx::parse_hca_caps(general.data(), general.size(), nullptr, 0);
    if (caps.atomic) {
        ret = query(devx::kCapTypeAtomic, atomic);
        if (ret) throw ProviderError(cmd_error("QUERY_HCA_CAP(atomic)", ret, atomic));
        caps = devx::parse_hca_caps(general.data(), general.size(), atomic.data(), atomic.size());
    }
    if (!caps.masked_fetch_add_32) {
        say(30, opts.device_name + " lacks 4-byte extended (masked) fetch-add: pyep's 32-bit RDMA signals "
                "will not work on it (atomic_operations 0x" + std::to_string(caps.atomic_operations) + ")");
    }
}

std::vector<std::string> devx_device_names() {
    const RdmaLib& lib = rdma_lib();
    if (!lib.error.empty()) throw ProviderError(lib.error);
    int n = 0;
    ibv_device** list = lib.get_device_list(&n);
    if (!list) throw ProviderError(device_list_error(errno));
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) names.emplace_back(lib.get_device_name(list[i]));
    lib.free_device_list(list);
    return names;
}

std::string devx_unavailable_reason(const std::string& device_name) {
    try {
        const auto names = devx_device_names();
        if (names.empty()) return "no RDMA device found (rdma-core sees none; is mlx5_ib loaded?)";
        for (const auto& n : names)
            if (n == device_name || device_name.empty()) return "";
        return "RDMA device '" + device_name + "' not found";
    } catch (const ProviderError& e) {
        return e.what();
    }
}

}  // namespace nic
}  // namespace pyep

#endif  // PYEP_HAVE_RDMA_CORE
