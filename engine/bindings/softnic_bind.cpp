// pyep._engine.SoftNic: the softnic provider for Python (pyep/softnic.py wraps it with types).
// Provider structs cross the boundary as the dicts of provider_dicts.h; C++ errors arrive as
// RuntimeError/ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/provider_dicts.h"
#include "bindings/registry.h"
#include "mlx5gda/softnic.h"

namespace py = pybind11;

namespace pyep {
namespace bindings {
namespace {

using nic::SoftNicProvider;

nic::MrInfo mr_from(const py::dict& d) {
    nic::MrInfo m;
    m.addr = d["addr"].cast<uint64_t>();
    m.length = d["length"].cast<uint64_t>();
    m.rkey = d["rkey"].cast<uint32_t>();
    m.lkey = d.contains("lkey") ? d["lkey"].cast<uint32_t>() : m.rkey;
    m.access = d["access"].cast<uint32_t>();
    return m;
}

py::dict qp_stats_dict(const softnic::QpStats& s) {
    py::dict d;
    d["qpn"] = s.qpn;
    d["state"] = s.state;
    d["remote_node"] = s.remote_node;
    d["remote_qpn"] = s.remote_qpn;
    d["wqes"] = s.wqes;
    d["bytes"] = s.bytes;
    d["atomics"] = s.atomics;
    d["errors"] = s.errors;
    d["flushed"] = s.flushed;
    d["cqes"] = s.cqes;
    d["doorbells"] = s.doorbells;
    d["consumer_index"] = s.consumer_index;
    d["pending"] = s.pending;
    d["last_syndrome"] = s.last_syndrome;
    d["last_vendor_syndrome"] = s.last_vendor_syndrome;
    d["last_error_wqe"] = s.last_error_wqe;
    d["last_error"] = s.last_error;
    return d;
}

py::dict cq_stats_dict(const softnic::CqStats& s) {
    py::dict d;
    d["cqn"] = s.cqn;
    d["log_size"] = s.log_size;
    d["producer_index"] = s.producer_index;
    d["consumer_index"] = s.consumer_index;
    d["overrun"] = s.overrun;
    d["error"] = s.error;
    return d;
}

py::dict peer_dict(const softnic::PeerInfo& p) {
    py::dict d;
    d["fabric_id"] = p.fabric_id;
    d["node_id"] = p.node_id;
    d["host_id"] = p.host_id;
    d["pid"] = p.pid;
    d["qpns"] = p.qpns;
    py::list mrs;
    for (const auto& m : p.mrs) mrs.append(mr_dict(m));
    d["mrs"] = mrs;
    return d;
}

void register_softnic(py::module_& m) {
    using R = py::call_guard<py::gil_scoped_release>;
    py::class_<SoftNicProvider>(m, "SoftNic", "Software mlx5 NIC (see pyep.softnic.SoftNic)")
        .def(py::init([](uint64_t fabric_id, uint64_t node_id, uint32_t max_mrs, uint32_t max_qps, uint32_t idle_spin,
                         uint32_t idle_sleep_us, int cuda_device) {
                 softnic::Options o;
                 o.fabric_id = fabric_id;
                 o.node_id = node_id;
                 o.max_mrs = max_mrs;
                 o.max_qps = max_qps;
                 o.idle_spin = idle_spin;
                 o.idle_sleep_us = idle_sleep_us;
                 o.cuda_device = cuda_device;
                 return new SoftNicProvider(o);
             }),
             py::arg("fabric_id"), py::arg("node_id"), py::arg("max_mrs"), py::arg("max_qps"), py::arg("idle_spin"),
             py::arg("idle_sleep_us"), py::arg("cuda_device"))
        .def_property_readonly("fabric_id", &SoftNicProvider::fabric_id)
        .def_property_readonly("node_id", &SoftNicProvider::node_id)
        .def_property_readonly("has_cuda", &SoftNicProvider::has_cuda)
        .def("query_caps", [](SoftNicProvider& s) {
            const nic::Caps c = s.query_caps();
            py::dict d;
            d["device_name"] = c.device_name;
            d["max_qp_wr_log"] = c.max_qp_wr_log;
            d["max_cqe_log"] = c.max_cqe_log;
            d["log_max_msg"] = c.log_max_msg;
            d["atomic_fa64"] = c.atomic_fa64;
            d["atomic_masked_fa32"] = c.atomic_masked_fa32;
            return d;
        })
        .def("create_cq", [](SoftNicProvider& s, uint32_t log_size, py::handle placement) {
            const nic::Placement where = placement_from(placement);
            nic::CqInfo c;
            {
                py::gil_scoped_release r;
                c = s.create_cq(log_size, where);
            }
            return cq_dict(c);
        }, py::arg("log_size"), py::arg("placement"))
        .def("create_qp", [](SoftNicProvider& s, uint32_t cqn, uint32_t log_sq, py::handle placement) {
            const nic::Placement where = placement_from(placement);
            nic::CqInfo cq;
            cq.cqn = cqn;
            nic::QpInfo q;
            {
                py::gil_scoped_release r;
                q = s.create_qp(cq, log_sq, where);
            }
            return qp_dict(q);
        }, py::arg("cqn"), py::arg("log_sq"), py::arg("placement"))
        .def("modify_qp_rst2init", &SoftNicProvider::modify_qp_rst2init, R(), py::arg("qpn"), py::arg("access"))
        .def("modify_qp_init2rtr", [](SoftNicProvider& s, uint32_t qpn, const py::dict& attr) {
            const nic::ConnectAttr a = connect_attr_from(attr);
            py::gil_scoped_release r;
            s.modify_qp_init2rtr(qpn, a);
        }, py::arg("qpn"), py::arg("attr"))
        .def("modify_qp_rtr2rts", [](SoftNicProvider& s, uint32_t qpn, const py::dict& attr) {
            const nic::ConnectAttr a = connect_attr_from(attr);
            py::gil_scoped_release r;
            s.modify_qp_rtr2rts(qpn, a);
        }, py::arg("qpn"), py::arg("attr"))
        .def("modify_qp_to_reset", &SoftNicProvider::modify_qp_to_reset, R(), py::arg("qpn"))
        .def("modify_qp_to_error", &SoftNicProvider::modify_qp_to_error, R(), py::arg("qpn"))
        .def("query_qp_state", &SoftNicProvider::query_qp_state, R(), py::arg("qpn"))
        .def("destroy_qp", &SoftNicProvider::destroy_qp, R(), py::arg("qpn"))
        .def("destroy_cq", &SoftNicProvider::destroy_cq, R(), py::arg("cqn"))
        .def("reg_mr", [](SoftNicProvider& s, uint64_t addr, uint64_t length, uint32_t access) {
            nic::MrInfo mr;
            {
                py::gil_scoped_release r;
                mr = s.reg_mr(reinterpret_cast<void*>(addr), length, access);
            }
            return mr_dict(mr);
        }, py::arg("addr"), py::arg("length"), py::arg("access"))
        .def("dereg_mr", &SoftNicProvider::dereg_mr, R(), py::arg("lkey"))
        .def("alloc_host", [](SoftNicProvider& s, uint64_t bytes) {
            py::gil_scoped_release r;
            return ptr_int(s.alloc_host(bytes));
        }, py::arg("bytes"))
        .def("free_host", [](SoftNicProvider& s, uint64_t addr) {
            py::gil_scoped_release r;
            s.free_host(reinterpret_cast<void*>(addr));
        }, py::arg("addr"))
        .def("start", &SoftNicProvider::start, R())
        .def("stop", &SoftNicProvider::stop, R())
        .def_property_readonly("running", &SoftNicProvider::running)
        .def("progress_once", &SoftNicProvider::progress_once, R())
        .def("drop_peer", &SoftNicProvider::drop_peer, R(), py::arg("node"), py::arg("blackhole"), py::arg("retry_ns"))
        .def("restore_peer", &SoftNicProvider::restore_peer, R(), py::arg("node"))
        .def("set_qp_delay", &SoftNicProvider::set_qp_delay, R(), py::arg("qpn"), py::arg("delay_ns"))
        .def("set_peer_delay", &SoftNicProvider::set_peer_delay, R(), py::arg("node"), py::arg("delay_ns"))
        .def("fail_after", &SoftNicProvider::fail_after, R(), py::arg("qpn"), py::arg("n"), py::arg("syndrome"))
        .def("force_error", &SoftNicProvider::force_error, R(), py::arg("qpn"))
        .def("invalidate_key", &SoftNicProvider::invalidate_key, R(), py::arg("key"))
        .def("clear_faults", &SoftNicProvider::clear_faults, R())
        .def("qp_stats", [](SoftNicProvider& s, uint32_t qpn) {
            softnic::QpStats st;
            {
                py::gil_scoped_release r;
                st = s.qp_stats(qpn);
            }
            return qp_stats_dict(st);
        }, py::arg("qpn"))
        .def("cq_stats", [](SoftNicProvider& s, uint32_t cqn) {
            softnic::CqStats st;
            {
                py::gil_scoped_release r;
                st = s.cq_stats(cqn);
            }
            return cq_stats_dict(st);
        }, py::arg("cqn"))
        .def("qpns", &SoftNicProvider::qpns, R())
        .def("drain_events", &SoftNicProvider::drain_events, R())
        .def("connect_blob", [](SoftNicProvider& s, const std::vector<uint32_t>& qpns, const std::vector<py::dict>& mrs) {
            std::vector<nic::MrInfo> infos;
            for (const auto& d : mrs) infos.push_back(mr_from(d));
            const std::vector<uint8_t> blob = softnic::encode_peer_info(s.peer_info(qpns, infos));
            return py::bytes(reinterpret_cast<const char*>(blob.data()), blob.size());
        }, py::arg("qpns"), py::arg("mrs"));

    m.def("softnic_parse_blob", [](const py::bytes& blob, uint64_t expect_fabric) {
        const std::string s = blob;
        return peer_dict(softnic::decode_peer_info(reinterpret_cast<const uint8_t*>(s.data()), s.size(), expect_fabric));
    }, py::arg("blob"), py::arg("expect_fabric"), "Validates and decodes a softnic connect blob (ValueError if bad)");
    m.def("softnic_host_id", &softnic::this_host_id);
    py::dict vendor;
    vendor["flush"] = (int)softnic::kVendFlush;
    vendor["qp_not_rts"] = (int)softnic::kVendQpNotRts;
    vendor["bad_wqe_index"] = (int)softnic::kVendBadWqeIndex;
    vendor["bad_qpn"] = (int)softnic::kVendBadQpn;
    vendor["bad_ds"] = (int)softnic::kVendBadDs;
    vendor["bad_opcode"] = (int)softnic::kVendBadOpcode;
    vendor["bad_doorbell"] = (int)softnic::kVendBadDoorbell;
    vendor["lkey"] = (int)softnic::kVendLkey;
    vendor["local_bounds"] = (int)softnic::kVendLbounds;
    vendor["local_access"] = (int)softnic::kVendLaccess;
    vendor["msg_len"] = (int)softnic::kVendMsgLen;
    vendor["fetch_len"] = (int)softnic::kVendFetchLen;
    vendor["rkey"] = (int)softnic::kVendRkey;
    vendor["remote_bounds"] = (int)softnic::kVendRbounds;
    vendor["remote_access"] = (int)softnic::kVendRaccess;
    vendor["qp_access"] = (int)softnic::kVendQpAccess;
    vendor["align"] = (int)softnic::kVendAlign;
    vendor["not_shareable"] = (int)softnic::kVendNotShareable;
    vendor["retry"] = (int)softnic::kVendRetry;
    vendor["dropped"] = (int)softnic::kVendDropped;
    vendor["injected"] = (int)softnic::kVendInjected;
    vendor["dma"] = (int)softnic::kVendDma;
    m.attr("softnic_vendor_syndromes") = vendor;
}

const Registrar registrar("softnic", &register_softnic);

}  // namespace
}  // namespace bindings
}  // namespace pyep
