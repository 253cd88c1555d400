// The nic::Provider structs as Python sees them, for every provider binding (softnic_bind.cpp,
// devx_bind.cpp): plain dicts of ints both ways, so no provider.h struct needs a pybind11 type, and
// one set of field names, bounds and error messages. Call with the GIL held.
#pragma once

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "mlx5gda/provider.h"

namespace pyep {
namespace bindings {
namespace py = pybind11;

inline uint64_t ptr_int(const void* p) { return (uint64_t)(uintptr_t)p; }

inline uint32_t u32(const char* name, uint64_t v) {
    if (v > 0xffffffffull) throw py::value_error(std::string(name) + "=" + std::to_string(v) + " does not fit in 32 bits");
    return (uint32_t)v;
}

inline uint64_t bounded(const char* name, py::handle v, uint64_t hi) {
    const uint64_t x = v.cast<uint64_t>();
    if (x > hi) throw py::value_error(std::string(name) + "=" + std::to_string(x) + " exceeds " + std::to_string(hi));
    return x;
}

inline void fixed_bytes(const char* name, const py::bytes& b, uint8_t* dst, size_t n) {
    const std::string s = b;
    if (s.size() != n) {
        throw py::value_error(std::string(name) + " must be exactly " + std::to_string(n) + " bytes, got " +
                              std::to_string(s.size()));
    }
    std::memcpy(dst, s.data(), n);
}

// 0/1/2 as pyep.softnic.Placement numbers them, or the names "host", "host_mapped", "device".
inline nic::Placement placement_from(py::handle h) {
    if (py::isinstance<py::str>(h)) {
        const std::string s = h.cast<std::string>();
        if (s == "host") return nic::Placement::Host;
        if (s == "host_mapped") return nic::Placement::HostMapped;
        if (s == "device") return nic::Placement::Device;
        throw py::value_error("placement must be 'host', 'host_mapped' or 'device', got '" + s + "'");
    }
    if (py::isinstance<py::bool_>(h) || !py::isinstance<py::int_>(h)) throw py::type_error("placement must be an int or a name");
    const int p = h.cast<int>();
    if (p == 0) return nic::Placement::Host;
    if (p == 1) return nic::Placement::HostMapped;
    if (p == 2) return nic::Placement::Device;
    throw py::value_error("placement must be 0 (host), 1 (host_mapped) or 2 (device), got " + std::to_string(p));
}

inline py::dict cq_dict(const nic::CqInfo& c) {
    py::dict d;
    d["cqn"] = c.cqn;
    d["log_size"] = c.log_size;
    d["cqes"] = ptr_int(c.cqes);
    d["dbrec"] = ptr_int(c.dbrec);
    return d;
}

inline py::dict qp_dict(const nic::QpInfo& q) {
    py::dict d;
    d["qpn"] = q.qpn;
    d["log_sq"] = q.log_sq;
    d["sq"] = ptr_int(q.sq);
    d["dbrec"] = ptr_int(q.dbrec);
    d["bf"] = ptr_int(q.bf);
    d["bf_size"] = q.bf_size;
    d["cqn"] = q.cqn;
    return d;
}

inline py::dict mr_dict(const nic::MrInfo& m) {
    py::dict d;
    d["addr"] = m.addr;
    d["length"] = m.length;
    d["lkey"] = m.lkey;
    d["rkey"] = m.rkey;
    d["access"] = m.access;
    return d;
}

// Connect attributes, flat keys. The peer's address: remote_node (softnic), or remote_lid /
// remote_gid / remote_mac, or "remote" = the dict local_address() returned on the peer.
inline nic::ConnectAttr connect_attr_from(const py::dict& d) {
    nic::ConnectAttr a;
    for (auto item : d) {
        const std::string k = item.first.cast<std::string>();
        py::handle v = item.second;
        if (k == "remote_qpn") a.remote_qpn = (uint32_t)bounded("remote_qpn", v, 0xffffff);
        else if (k == "remote_node") a.remote.node_id = v.cast<uint64_t>();
        else if (k == "remote_lid") a.remote.lid = (uint16_t)bounded("remote_lid", v, 0xffff);
        else if (k == "remote_gid") fixed_bytes("remote_gid", v.cast<py::bytes>(), a.remote.gid, 16);
        else if (k == "remote_mac") fixed_bytes("remote_mac", v.cast<py::bytes>(), a.remote.mac, 6);
        else if (k == "remote") {
            const py::dict r = v.cast<py::dict>();
            if (r.contains("node_id")) a.remote.node_id = r["node_id"].cast<uint64_t>();
            if (r.contains("lid")) a.remote.lid = (uint16_t)bounded("remote.lid", r["lid"], 0xffff);
            if (r.contains("gid")) fixed_bytes("remote.gid", r["gid"].cast<py::bytes>(), a.remote.gid, 16);
            if (r.contains("mac")) fixed_bytes("remote.mac", r["mac"].cast<py::bytes>(), a.remote.mac, 6);
        }
        else if (k == "mtu") a.mtu = (uint32_t)bounded("mtu", v, 4096);
        else if (k == "retry_cnt") a.retry_cnt = (uint8_t)bounded("retry_cnt", v, 7);
        else if (k == "rnr_retry") a.rnr_retry = (uint8_t)bounded("rnr_retry", v, 7);
        else if (k == "ack_timeout") a.ack_timeout = (uint8_t)bounded("ack_timeout", v, 31);
        else if (k == "min_rnr_timer") a.min_rnr_timer = (uint8_t)bounded("min_rnr_timer", v, 31);
        else if (k == "sq_psn") a.sq_psn = (uint32_t)bounded("sq_psn", v, 0xffffff);
        else if (k == "rq_psn") a.rq_psn = (uint32_t)bounded("rq_psn", v, 0xffffff);
        else if (k == "max_rd_atomic") a.max_rd_atomic = (uint8_t)bounded("max_rd_atomic", v, 255);
        else if (k == "sl") a.sl = (uint8_t)bounded("sl", v, 15);
        else if (k == "traffic_class") a.traffic_class = (uint8_t)bounded("traffic_class", v, 255);
        else if (k == "udp_sport") a.udp_sport = (uint16_t)bounded("udp_sport", v, 0xffff);
        else throw py::value_error("unknown connect attribute '" + k + "'");
    }
    return a;
}

}  // namespace bindings
}  // namespace pyep
