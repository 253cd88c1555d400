// pyep._engine.wqe: the WQE/CQE encoders and decoders of mlx5gda/wqe.h, bytes in and bytes out.
//
// Python never re-implements the encoding: diagnostics, the CLI and the tests all go through the
// same functions the GPU kernels and the softnic use. Every numeric argument arrives as a 64-bit value
// and is range-checked here against its field width, because the C++ structs would otherwise
// truncate an out-of-range value silently into a well-formed but wrong WQE.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "bindings/registry.h"
#include "mlx5gda/prm.h"
#include "mlx5gda/wqe.h"

namespace py = pybind11;

namespace pyep {
namespace bindings {
namespace {

void check_width(const char* field, uint64_t value, int bits) {
    if (bits < 64 && value >> bits) {
        throw py::value_error(std::string(field) + "=" + std::to_string(value) + " does not fit in " +
                              std::to_string(bits) + " bits");
    }
}

std::string take_bytes(const py::bytes& data, size_t expect, const char* what) {
    std::string s = data;
    if (s.size() != expect) {
        throw py::value_error(std::string(what) + " must be exactly " + std::to_string(expect) + " bytes, got " +
                              std::to_string(s.size()));
    }
    return s;
}

py::bytes encode_wqe(uint64_t opcode, uint64_t wqe_index, uint64_t qpn, bool signaled, bool fence,
                     uint64_t laddr, uint64_t lkey, uint64_t raddr, uint64_t rkey, uint64_t length,
                     uint64_t add) {
    check_width("opcode", opcode, 8);
    if (gda::wqe_ds((uint8_t)opcode) == 0) {
        throw py::value_error("opcode " + std::to_string(opcode) + " is not one pyep posts "
                              "(NOP, RDMA_WRITE, ATOMIC_MASKED_FA, ATOMIC_FA)");
    }
    check_width("wqe_index", wqe_index, 16);
    check_width("qpn", qpn, 24);
    check_width("lkey", lkey, 32);
    check_width("rkey", rkey, 32);
    // Bit 31 of a data segment's byte_count is MLX5_INLINE_SEG; a pointer segment must leave it clear.
    check_width("length", length, 31);
    check_width("add", add, opcode == prm::kOpAtomicMaskedFa ? 32 : 64);
    gda::WorkRequest wr;
    wr.opcode = (uint8_t)opcode;
    wr.signaled = signaled;
    wr.fence = fence;
    wr.laddr = laddr;
    wr.lkey = (uint32_t)lkey;
    wr.raddr = raddr;
    wr.rkey = (uint32_t)rkey;
    wr.length = (uint32_t)length;
    wr.add = add;
    gda::WqeWords words;
    gda::encode_wqe(wr, (uint16_t)wqe_index, (uint32_t)qpn, &words);
    return py::bytes(reinterpret_cast<const char*>(&words), sizeof(words));
}

py::dict decode_wqe(const py::bytes& data) {
    const std::string s = take_bytes(data, prm::kSendWqeBB, "a WQEBB");
    gda::WqeWords words;
    std::memcpy(&words, s.data(), sizeof(words));
    const gda::DecodedWqe d = gda::decode_wqe(&words);
    py::dict out;
    out["opcode"] = d.opcode;
    out["opmod"] = d.opmod;
    out["wqe_index"] = d.wqe_index;
    out["qpn"] = d.qpn;
    out["ds"] = d.ds;
    out["signature"] = d.signature;
    out["fm_ce_se"] = d.fm_ce_se;
    out["imm"] = d.imm;
    out["signaled"] = d.wr.signaled;
    out["fence"] = d.wr.fence;
    out["raddr"] = d.wr.raddr;
    out["rkey"] = d.wr.rkey;
    out["laddr"] = d.wr.laddr;
    out["lkey"] = d.wr.lkey;
    out["length"] = d.wr.length;
    out["add"] = d.wr.add;
    out["field_boundary"] = d.field_boundary;
    out["compare"] = d.compare;
    return out;
}

py::dict decode_cqe(const py::bytes& data) {
    const std::string s = take_bytes(data, prm::kCqeBytes, "a CQE");
    prm::Cqe64 cqe;
    std::memcpy(&cqe, s.data(), sizeof(cqe));
    const gda::DecodedCqe d = gda::decode_cqe(&cqe);
    py::dict out;
    out["opcode"] = d.opcode;
    out["owner"] = d.owner;
    out["syndrome"] = d.syndrome;
    out["vendor_syndrome"] = d.vendor_syndrome;
    out["wqe_opcode"] = d.wqe_opcode;
    out["wqe_counter"] = d.wqe_counter;
    out["qpn"] = d.qpn;
    out["byte_cnt"] = d.byte_cnt;
    out["op_own"] = cqe.op_own;  // raw: also carries the solicited-event and CQE-format bits
    out["signature"] = cqe.signature;
    return out;
}

py::bytes encode_cqe(uint64_t opcode, uint64_t owner, uint64_t wqe_counter, uint64_t qpn, uint64_t byte_cnt,
                     uint64_t wqe_opcode, uint64_t syndrome, uint64_t vendor_syndrome) {
    check_width("opcode", opcode, 4);
    check_width("owner", owner, 1);
    check_width("wqe_counter", wqe_counter, 16);
    check_width("qpn", qpn, 24);
    check_width("byte_cnt", byte_cnt, 32);
    check_width("wqe_opcode", wqe_opcode, 8);
    check_width("syndrome", syndrome, 8);
    check_width("vendor_syndrome", vendor_syndrome, 8);
    gda::DecodedCqe d{};
    d.opcode = (uint8_t)opcode;
    d.owner = (uint8_t)owner;
    d.wqe_counter = (uint16_t)wqe_counter;
    d.qpn = (uint32_t)qpn;
    d.byte_cnt = (uint32_t)byte_cnt;
    d.wqe_opcode = (uint8_t)wqe_opcode;
    d.syndrome = (uint8_t)syndrome;
    d.vendor_syndrome = (uint8_t)vendor_syndrome;
    prm::Cqe64 cqe;
    gda::encode_cqe_body(&cqe, d);
    cqe.op_own = gda::cqe_op_own(d.opcode, d.owner);
    return py::bytes(reinterpret_cast<const char*>(&cqe), sizeof(cqe));
}

// prm.h's values, so Python's named enums can be checked against the one place they are defined.
py::dict constants() {
    py::dict opcodes, ctrl, cqe, synd, misc;
    opcodes["NOP"] = (int)prm::kOpNop;
    opcodes["RDMA_WRITE"] = (int)prm::kOpRdmaWrite;
    opcodes["RDMA_WRITE_IMM"] = (int)prm::kOpRdmaWriteImm;
    opcodes["SEND"] = (int)prm::kOpSend;
    opcodes["RDMA_READ"] = (int)prm::kOpRdmaRead;
    opcodes["ATOMIC_CS"] = (int)prm::kOpAtomicCs;
    opcodes["ATOMIC_FA"] = (int)prm::kOpAtomicFa;
    opcodes["ATOMIC_MASKED_CS"] = (int)prm::kOpAtomicMaskedCs;
    opcodes["ATOMIC_MASKED_FA"] = (int)prm::kOpAtomicMaskedFa;
    ctrl["SOLICITED"] = (int)prm::kCtrlSolicited;
    ctrl["CQ_UPDATE"] = (int)prm::kCtrlCqUpdate;
    ctrl["SMALL_FENCE"] = (int)prm::kCtrlSmallFence;
    ctrl["FENCE"] = (int)prm::kCtrlFence;
    cqe["REQ"] = (int)prm::kCqeReq;
    cqe["RESP_WR_IMM"] = (int)prm::kCqeRespWrImm;
    cqe["RESP_SEND"] = (int)prm::kCqeRespSend;
    cqe["REQ_ERR"] = (int)prm::kCqeReqErr;
    cqe["RESP_ERR"] = (int)prm::kCqeRespErr;
    cqe["INVALID"] = (int)prm::kCqeInvalid;
    synd["LOCAL_LENGTH_ERR"] = (int)prm::kSyndLocalLengthErr;
    synd["LOCAL_QP_OP_ERR"] = (int)prm::kSyndLocalQpOpErr;
    synd["LOCAL_PROT_ERR"] = (int)prm::kSyndLocalProtErr;
    synd["WR_FLUSH_ERR"] = (int)prm::kSyndWrFlushErr;
    synd["MW_BIND_ERR"] = (int)prm::kSyndMwBindErr;
    synd["BAD_RESP_ERR"] = (int)prm::kSyndBadRespErr;
    synd["LOCAL_ACCESS_ERR"] = (int)prm::kSyndLocalAccessErr;
    synd["REMOTE_INVAL_REQ_ERR"] = (int)prm::kSyndRemoteInvalReqErr;
    synd["REMOTE_ACCESS_ERR"] = (int)prm::kSyndRemoteAccessErr;
    synd["REMOTE_OP_ERR"] = (int)prm::kSyndRemoteOpErr;
    synd["TRANSPORT_RETRY_EXC_ERR"] = (int)prm::kSyndTransportRetryExcErr;
    synd["RNR_RETRY_EXC_ERR"] = (int)prm::kSyndRnrRetryExcErr;
    synd["REMOTE_ABORTED_ERR"] = (int)prm::kSyndRemoteAbortedErr;
    misc["SEND_WQE_BB"] = prm::kSendWqeBB;
    misc["SEG_BYTES"] = prm::kSegBytes;
    misc["CQE_BYTES"] = prm::kCqeBytes;
    misc["OPMOD_EXT_ATOMIC_4B"] = (int)prm::kOpmodExtAtomic4B;
    misc["OPMOD_EXT_ATOMIC_8B"] = (int)prm::kOpmodExtAtomic8B;
    misc["ERR_CQE_SYNDROME_OFFSET"] = prm::kErrCqeSyndromeOffset;
    misc["ERR_CQE_VENDOR_SYND_OFFSET"] = prm::kErrCqeVendorSyndOffset;
    py::dict out;
    out["opcodes"] = opcodes;
    out["ctrl_flags"] = ctrl;
    out["cqe_opcodes"] = cqe;
    out["syndromes"] = synd;
    out["misc"] = misc;
    return out;
}

void register_wqe(py::module_& m) {
    py::module_ w = m.def_submodule("wqe", "mlx5 send-WQE and CQE encoding/decoding (mlx5gda/wqe.h)");
    w.def("encode_wqe", &encode_wqe, py::arg("opcode"), py::arg("wqe_index"), py::arg("qpn"),
          py::arg("signaled") = false, py::arg("fence") = false, py::arg("laddr") = 0, py::arg("lkey") = 0,
          py::arg("raddr") = 0, py::arg("rkey") = 0, py::arg("length") = 0, py::arg("add") = 0,
          "The 64-byte WQEBB pyep's encoder builds for this work request.");
    w.def("decode_wqe", &decode_wqe, py::arg("wqebb"), "Fields of a 64-byte WQEBB, as a dict.");
    w.def("decode_cqe", &decode_cqe, py::arg("cqe"), "Fields of a 64-byte CQE, as a dict.");
    w.def("encode_cqe", &encode_cqe, py::arg("opcode"), py::arg("owner"), py::arg("wqe_counter"), py::arg("qpn"),
          py::arg("byte_cnt") = 0, py::arg("wqe_opcode") = 0, py::arg("syndrome") = 0,
          py::arg("vendor_syndrome") = 0, "A 64-byte CQE as the softnic writes it (op_own included).");
    w.def("constants", &constants, "prm.h's opcodes, ctrl flags, CQE opcodes and syndromes.");
    w.def("wqe_ds", [](uint8_t opcode) { return gda::wqe_ds(opcode); }, py::arg("opcode"),
          "16-byte segments pyep's WQE for this opcode uses (0: not an opcode pyep posts).");
}

const Registrar registrar("wqe", &register_wqe);

}  // namespace
}  // namespace bindings
}  // namespace pyep
