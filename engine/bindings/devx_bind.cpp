// pyep._engine.devx: the PRM command encoders/parsers of mlx5gda/devx_cmd.h (bytes in, bytes out) and,
// in builds with rdma-core headers, the DevX provider.
//
// Arguments arrive as 64-bit integers and are range-checked here: narrowing a too-large value into a
// 32-bit parameter would otherwise produce a well-formed but wrong mailbox. The provider's setup
// objects cross the boundary as dicts (addresses as ints), the same shapes the softnic binding's
// Python wrapper uses, so pyep.transport.connect drives either provider.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "bindings/provider_dicts.h"
#include "bindings/registry.h"
#include "mlx5gda/devx_cmd.h"
#include "mlx5gda/devx_provider.h"

#if defined(PYEP_HAVE_RDMA_CORE)
#include <infiniband/mlx5dv.h>
#endif

namespace py = pybind11;

namespace pyep {
namespace bindings {
namespace {



py::bytes out(const devx::Bytes& b) { return py::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }

py::dict caps_dict(const devx::HcaCaps& c) {
    py::dict d;
    d["log_max_qp_sz"] = c.log_max_qp_sz;
    d["log_max_qp"] = c.log_max_qp;
    d["log_max_cq_sz"] = c.log_max_cq_sz;
    d["log_max_cq"] = c.log_max_cq;
    d["log_max_msg"] = c.log_max_msg;
    d["log_max_pd"] = c.log_max_pd;
    d["cqe_version"] = c.cqe_version;
    d["port_type"] = c.port_type;
    d["num_ports"] = c.num_ports;
    d["log_bf_reg_size"] = c.log_bf_reg_size;
    d["log_max_ra_req_qp"] = c.log_max_ra_req_qp;
    d["log_max_ra_res_qp"] = c.log_max_ra_res_qp;
    d["sq_ts_format"] = c.sq_ts_format;
    d["atomic"] = c.atomic;
    d["roce"] = c.roce;
    d["rc"] = c.rc;
    d["uar_4k"] = c.uar_4k;
    d["umem_uid_0"] = c.umem_uid_0;
    d["atomic_operations"] = c.atomic_operations;
    d["atomic_size_qp"] = c.atomic_size_qp;
    d["atomic_req_8b_endianness_mode"] = c.atomic_req_8b_endianness_mode;
    d["fetch_add_64"] = c.fetch_add_64;
    d["masked_fetch_add_32"] = c.masked_fetch_add_32;
    return d;
}

void register_encoders(py::module_& d) {
    d.def("get_field", [](const py::bytes& data, uint32_t bit_off, uint32_t width) {
        const std::string s = data;
        return devx::get_field(reinterpret_cast<const uint8_t*>(s.data()), s.size(), bit_off, width);
    }, py::arg("data"), py::arg("bit_off"), py::arg("width"),
       "Big-endian PRM bit field (bit 0 = MSB of byte 0) of `width` bits at `bit_off`.");
    d.def("set_field", [](const py::bytes& data, uint32_t bit_off, uint32_t width, uint64_t value) {
        std::string s = data;
        devx::set_field(reinterpret_cast<uint8_t*>(&s[0]), s.size(), bit_off, width, value);
        return py::bytes(s);
    }, py::arg("data"), py::arg("bit_off"), py::arg("width"), py::arg("value"), "Copy of `data` with the field set.");

    d.def("encode_create_cq", [](uint64_t log_cq_size, uint64_t uar_page, uint64_t eqn, uint64_t cq_umem_id,
                                 uint64_t cq_umem_offset, uint64_t dbr_umem_id, uint64_t dbr_offset,
                                 uint64_t log_page_size, bool collapsed, bool overrun_ignore) {
        devx::CreateCqParams p;
        p.log_cq_size = u32("log_cq_size", log_cq_size);
        p.uar_page = u32("uar_page", uar_page);
        p.eqn = u32("eqn", eqn);
        p.cq_umem_id = u32("cq_umem_id", cq_umem_id);
        p.cq_umem_offset = cq_umem_offset;
        p.dbr_umem_id = u32("dbr_umem_id", dbr_umem_id);
        p.dbr_offset = dbr_offset;
        p.log_page_size = u32("log_page_size", log_page_size);
        p.collapsed = collapsed;
        p.overrun_ignore = overrun_ignore;
        return out(devx::encode_create_cq(p));
    }, py::arg("log_cq_size"), py::arg("uar_page"), py::arg("eqn"), py::arg("cq_umem_id"),
       py::arg("cq_umem_offset") = 0, py::arg("dbr_umem_id") = 0, py::arg("dbr_offset") = 0,
       py::arg("log_page_size") = 0, py::arg("collapsed") = false, py::arg("overrun_ignore") = false);

    d.def("encode_create_qp", [](uint64_t pd, uint64_t uar_page, uint64_t cqn_snd, uint64_t cqn_rcv,
                                 uint64_t log_sq_size, uint64_t log_msg_max, uint64_t wq_umem_id,
                                 uint64_t wq_umem_offset, uint64_t dbr_umem_id, uint64_t dbr_offset,
                                 uint64_t log_page_size, uint64_t ts_format, uint64_t user_index) {
        devx::CreateQpParams p;
        p.pd = u32("pd", pd);
        p.uar_page = u32("uar_page", uar_page);
        p.cqn_snd = u32("cqn_snd", cqn_snd);
        p.cqn_rcv = u32("cqn_rcv", cqn_rcv);
        p.log_sq_size = u32("log_sq_size", log_sq_size);
        p.log_msg_max = u32("log_msg_max", log_msg_max);
        p.wq_umem_id = u32("wq_umem_id", wq_umem_id);
        p.wq_umem_offset = wq_umem_offset;
        p.dbr_umem_id = u32("dbr_umem_id", dbr_umem_id);
        p.dbr_offset = dbr_offset;
        p.log_page_size = u32("log_page_size", log_page_size);
        p.ts_format = u32("ts_format", ts_format);
        p.user_index = u32("user_index", user_index);
        return out(devx::encode_create_qp(p));
    }, py::arg("pd"), py::arg("uar_page"), py::arg("cqn_snd"), py::arg("cqn_rcv"), py::arg("log_sq_size"),
       py::arg("log_msg_max"), py::arg("wq_umem_id"), py::arg("wq_umem_offset") = 0, py::arg("dbr_umem_id") = 0,
       py::arg("dbr_offset") = 0, py::arg("log_page_size") = 0, py::arg("ts_format") = 0, py::arg("user_index") = 0);

    d.def("encode_rst2init", [](uint64_t qpn, uint64_t port, uint64_t pkey_index, bool remote_read,
                                bool remote_write, bool remote_atomic, uint64_t atomic_mode) {
        devx::Rst2InitParams p;
        p.qpn = u32("qpn", qpn);
        p.port = u32("port", port);
        p.pkey_index = u32("pkey_index", pkey_index);
        p.remote_read = remote_read;
        p.remote_write = remote_write;
        p.remote_atomic = remote_atomic;
        p.atomic_mode = u32("atomic_mode", atomic_mode);
        return out(devx::encode_rst2init(p));
    }, py::arg("qpn"), py::arg("port") = 1, py::arg("pkey_index") = 0, py::arg("remote_read") = false,
       py::arg("remote_write") = false, py::arg("remote_atomic") = false, py::arg("atomic_mode") = 0);

    d.def("encode_init2rtr", [](uint64_t qpn, uint64_t mtu, uint64_t log_msg_max, uint64_t remote_qpn,
                                uint64_t next_rcv_psn, uint64_t min_rnr_nak, uint64_t log_rra_max, uint64_t port,
                                bool roce, uint64_t rlid, uint64_t sl, bool grh, const py::bytes& rgid,
                                const py::bytes& rmac, uint64_t src_addr_index, uint64_t hop_limit,
                                uint64_t traffic_class, uint64_t flow_label, uint64_t udp_sport) {
        devx::Init2RtrParams p;
        p.qpn = u32("qpn", qpn);
        p.mtu = u32("mtu", mtu);
        p.log_msg_max = u32("log_msg_max", log_msg_max);
        p.remote_qpn = u32("remote_qpn", remote_qpn);
        p.next_rcv_psn = u32("next_rcv_psn", next_rcv_psn);
        p.min_rnr_nak = u32("min_rnr_nak", min_rnr_nak);
        p.log_rra_max = u32("log_rra_max", log_rra_max);
        p.port = u32("port", port);
        p.roce = roce;
        p.rlid = u32("rlid", rlid);
        p.sl = u32("sl", sl);
        p.grh = grh;
        fixed_bytes("rgid", rgid, p.rgid, 16);
        fixed_bytes("rmac", rmac, p.rmac, 6);
        p.src_addr_index = u32("src_addr_index", src_addr_index);
        p.hop_limit = u32("hop_limit", hop_limit);
        p.traffic_class = u32("traffic_class", traffic_class);
        p.flow_label = u32("flow_label", flow_label);
        p.udp_sport = u32("udp_sport", udp_sport);
        return out(devx::encode_init2rtr(p));
    }, py::arg("qpn"), py::arg("mtu"), py::arg("log_msg_max"), py::arg("remote_qpn"), py::arg("next_rcv_psn") = 0,
       py::arg("min_rnr_nak") = 12, py::arg("log_rra_max") = 4, py::arg("port") = 1, py::arg("roce") = false,
       py::arg("rlid") = 0, py::arg("sl") = 0, py::arg("grh") = false, py::arg("rgid") = py::bytes(std::string(16, '\0')),
       py::arg("rmac") = py::bytes(std::string(6, '\0')), py::arg("src_addr_index") = 0, py::arg("hop_limit") = 64,
       py::arg("traffic_class") = 0, py::arg("flow_label") = 0, py::arg("udp_sport") = 0);

    d.def("encode_rtr2rts", [](uint64_t qpn, uint64_t retry_count, uint64_t rnr_retry, uint64_t ack_timeout,
                               uint64_t next_send_psn, uint64_t log_sra_max, uint64_t log_ack_req_freq) {
        devx::Rtr2RtsParams p;
        p.qpn = u32("qpn", qpn);
        p.retry_count = u32("retry_count", retry_count);
        p.rnr_retry = u32("rnr_retry", rnr_retry);
        p.ack_timeout = u32("ack_timeout", ack_timeout);
        p.next_send_psn = u32("next_send_psn", next_send_psn);
        p.log_sra_max = u32("log_sra_max", log_sra_max);
        p.log_ack_req_freq = u32("log_ack_req_freq", log_ack_req_freq);
        return out(devx::encode_rtr2rts(p));
    }, py::arg("qpn"), py::arg("retry_count") = 7, py::arg("rnr_retry") = 7, py::arg("ack_timeout") = 20,
       py::arg("next_send_psn") = 0, py::arg("log_sra_max") = 4, py::arg("log_ack_req_freq") = 0);

    d.def("encode_qp_2err", [](uint64_t qpn) { return out(devx::encode_qp_2err(u32("qpn", qpn))); }, py::arg("qpn"));
    d.def("encode_qp_2rst", [](uint64_t qpn) { return out(devx::encode_qp_2rst(u32("qpn", qpn))); }, py::arg("qpn"));
    d.def("encode_query_qp", [](uint64_t qpn) { return out(devx::encode_query_qp(u32("qpn", qpn))); }, py::arg("qpn"));
    d.def("encode_query_hca_cap", [](uint64_t cap_type, bool current) {
        if (cap_type > 0x7fff) throw py::value_error("cap_type must be < 0x8000");
        return out(devx::encode_query_hca_cap((uint16_t)cap_type, current));
    }, py::arg("cap_type"), py::arg("current") = true);

    d.def("parse_hca_caps", [](const py::bytes& general, const py::bytes& atomic) {
        const std::string g = general, a = atomic;
        return caps_dict(devx::parse_hca_caps(reinterpret_cast<const uint8_t*>(g.data()), g.size(),
                                              reinterpret_cast<const uint8_t*>(a.data()), a.size()));
    }, py::arg("general"), py::arg("atomic") = py::bytes(""),
       "Capabilities from QUERY_HCA_CAP outputs (general device caps, atomic caps).");
    d.def("parse_status", [](const py::bytes& o) {
        const std::string s = o;
        const devx::CmdStatus st = devx::parse_status(reinterpret_cast<const uint8_t*>(s.data()), s.size());
        return py::make_tuple(st.status, st.syndrome, devx::status_name(st.status));
    }, py::arg("out"), "(status, syndrome, status name) of a command output.");
    d.def("parse_created_id", [](const py::bytes& o) {
        const std::string s = o;
        return devx::parse_created_id(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    }, py::arg("out"));
    d.def("parse_query_qp_state", [](const py::bytes& o) {
        const std::string s = o;
        return devx::parse_query_qp_state(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    }, py::arg("out"));
    d.def("atomic_mode_for", [](uint64_t size_mask) {
        if (size_mask > 0xffff) throw py::value_error("atomic_size_qp is a 16-bit mask");
        return devx::atomic_mode_for((uint16_t)size_mask);
    }, py::arg("atomic_size_qp"));
    d.def("mtu_enum", [](uint64_t bytes) { return devx::mtu_enum(u32("mtu", bytes)); }, py::arg("mtu"));

    py::dict ops;
    ops["QUERY_HCA_CAP"] = (int)devx::kCmdQueryHcaCap;
    ops["CREATE_CQ"] = (int)devx::kCmdCreateCq;
    ops["DESTROY_CQ"] = (int)devx::kCmdDestroyCq;
    ops["CREATE_QP"] = (int)devx::kCmdCreateQp;
    ops["DESTROY_QP"] = (int)devx::kCmdDestroyQp;
    ops["RST2INIT_QP"] = (int)devx::kCmdRst2InitQp;
    ops["INIT2RTR_QP"] = (int)devx::kCmdInit2RtrQp;
    ops["RTR2RTS_QP"] = (int)devx::kCmdRtr2RtsQp;
    ops["2ERR_QP"] = (int)devx::kCmd2ErrQp;
    ops["2RST_QP"] = (int)devx::kCmd2RstQp;
    ops["QUERY_QP"] = (int)devx::kCmdQueryQp;
    d.attr("OPCODES") = ops;
    d.attr("QUERY_HCA_CAP_OUT_BYTES") = devx::kQueryHcaCapOutBytes;
    d.attr("QUERY_QP_OUT_BYTES") = devx::kQueryQpOutBytes;
}

#if defined(PYEP_HAVE_RDMA_CORE)
py::dict address_dict(const nic::Address& a) {
    py::dict d;
    d["node_id"] = a.node_id;
    d["lid"] = a.lid;
    d["gid"] = py::bytes(reinterpret_cast<const char*>(a.gid), 16);
    d["mac"] = py::bytes(reinterpret_cast<const char*>(a.mac), 6);
    d["port"] = a.port;
    d["gid_index"] = a.gid_index;
    return d;
}

void register_provider(py::module_& d) {
    using nic::DevxProvider;
    py::class_<DevxProvider>(d, "DevxProvider",
                             "nic::Provider over a real ConnectX (DevX). Opening fails with RuntimeError saying why "
                             "when rdma-core, the device or DevX access is missing.")
        .def(py::init([](const std::string& device_name, uint64_t port, int gid_index, bool allow_dmabuf,
                         bool allow_peermem, bool allow_host_fallback) {
                 if (port < 1 || port > 255) throw py::value_error("port must be in 1..255");
                 if (gid_index < -1 || gid_index > 255) throw py::value_error("gid_index must be -1 (auto) or 0..255");
                 nic::DevxOptions o;
                 o.device_name = device_name;
                 o.port = (uint8_t)port;
                 o.gid_index = gid_index;
                 o.allow_dmabuf = allow_dmabuf;
                 o.allow_peermem = allow_peermem;
                 o.allow_host_fallback = allow_host_fallback;
                 py::object logger = py::module_::import("logging").attr("getLogger")("pyep.devx");
                 nic::LogFn fn = [logger](int level, const std::string& msg) {
                     py::gil_scoped_acquire g;
                     logger.attr("log")(level, msg);
                 };
                 return std::make_unique<DevxProvider>(o, fn);
             }),
             py::arg("device_name"), py::arg("port") = 1, py::arg("gid_index") = -1, py::arg("allow_dmabuf") = true,
             py::arg("allow_peermem") = true, py::arg("allow_host_fallback") = true)
        .def("kind", &DevxProvider::kind)
        .def("query_caps", [](DevxProvider& p) {
            const nic::Caps c = p.query_caps();
            py::dict r;
            r["device_name"] = c.device_name;
            r["max_qp_wr_log"] = c.max_qp_wr_log;
            r["max_cqe_log"] = c.max_cqe_log;
            r["log_max_msg"] = c.log_max_msg;
            r["cqe_version"] = c.cqe_version;
            r["atomic_fa64"] = c.atomic_fa64;
            r["atomic_masked_fa32"] = c.atomic_masked_fa32;
            r["ib"] = c.ib;
            return r;
        })
        .def("hca_caps", [](DevxProvider& p) { return caps_dict(p.hca_caps()); })
        .def("local_address", [](DevxProvider& p) { return address_dict(p.local_address()); })
        .def("create_cq", [](DevxProvider& p, uint64_t log_size, py::handle placement) {
            return cq_dict(p.create_cq(u32("log_size", log_size), placement_from(placement)));
        }, py::arg("log_size"), py::arg("placement") = py::int_(0))
        .def("create_qp", [](DevxProvider& p, uint64_t cqn, uint64_t log_sq, py::handle placement) {
            nic::CqInfo cq;
            cq.cqn = u32("cqn", cqn);
            return qp_dict(p.create_qp(cq, u32("log_sq", log_sq), placement_from(placement)));
        }, py::arg("cqn"), py::arg("log_sq"), py::arg("placement") = py::int_(0))
        .def("modify_qp_rst2init", [](DevxProvider& p, uint64_t qpn, uint64_t access) {
            p.modify_qp_rst2init(u32("qpn", qpn), u32("access", access));
        }, py::arg("qpn"), py::arg("access"))
        .def("modify_qp_init2rtr", [](DevxProvider& p, uint64_t qpn, const py::dict& attr) {
            p.modify_qp_init2rtr(u32("qpn", qpn), connect_attr_from(attr));
        }, py::arg("qpn"), py::arg("attr"))
        .def("modify_qp_rtr2rts", [](DevxProvider& p, uint64_t qpn, const py::dict& attr) {
            p.modify_qp_rtr2rts(u32("qpn", qpn), connect_attr_from(attr));
        }, py::arg("qpn"), py::arg("attr"))
        .def("modify_qp_to_reset", [](DevxProvider& p, uint64_t qpn) { p.modify_qp_to_reset(u32("qpn", qpn)); })
        .def("modify_qp_to_error", [](DevxProvider& p, uint64_t qpn) { p.modify_qp_to_error(u32("qpn", qpn)); })
        .def("query_qp_state", [](DevxProvider& p, uint64_t qpn) { return p.query_qp_state(u32("qpn", qpn)); })
        .def("destroy_qp", [](DevxProvider& p, uint64_t qpn) { p.destroy_qp(u32("qpn", qpn)); })
        .def("destroy_cq", [](DevxProvider& p, uint64_t cqn) { p.destroy_cq(u32("cqn", cqn)); })
        .def("reg_mr", [](DevxProvider& p, uint64_t addr, uint64_t length, uint64_t access) {
            return mr_dict(p.reg_mr(reinterpret_cast<void*>(addr), length, u32("access", access)));
        }, py::arg("addr"), py::arg("length"), py::arg("access"))
        .def("dereg_mr", [](DevxProvider& p, uint64_t lkey) { p.dereg_mr(u32("lkey", lkey)); })
        .def("placements", &DevxProvider::placements)
        .def_property_readonly("pdn", &DevxProvider::pdn)
        .def_property_readonly("active_mtu", &DevxProvider::active_mtu)
        .def_property_readonly("link_is_ib", &DevxProvider::link_is_ib);
    d.def("device_names", &nic::devx_device_names, "RDMA devices rdma-core sees (RuntimeError if it cannot look).");
    d.def("unavailable_reason", &nic::devx_unavailable_reason, py::arg("device_name") = "",
          "'' when a DevxProvider can probably be opened here, else why not.");
}
#endif

void register_devx(py::module_& m) {
    py::module_ d = m.def_submodule("devx", "mlx5 PRM command mailboxes and the DevX provider");
    register_encoders(d);
#if defined(PYEP_HAVE_RDMA_CORE)
    d.attr("has_provider") = true;
    register_provider(d);
    // rdma-core's own DEVX_SET primitive (mlx5dv.h), for tests: an independent oracle of the PRM bit
    // convention for fields inside one 32-bit word.
    d.def("rdma_core_set_field", [](const py::bytes& data, uint32_t bit_off, uint32_t width, uint32_t value) {
        std::string s = data;
        if (width == 0 || width > 32 || (bit_off % 32) + width > 32 || (bit_off / 32 + 1) * 4 > s.size())
            throw py::value_error("field must lie inside one 32-bit word of the buffer");
        _devx_set(&s[0], value, bit_off, width);
        return py::bytes(s);
    }, py::arg("data"), py::arg("bit_off"), py::arg("width"), py::arg("value"));
#else
    d.attr("has_provider") = false;
    d.attr("unavailable") = "built without rdma-core headers (infiniband/mlx5dv.h): no DevX provider in this build";
#endif
}

Registrar reg("devx", register_devx);

}  // namespace
}  // namespace bindings
}  // namespace pyep
