// PRM mailbox encoders/parsers. Field offsets: mlx5_ifc create_cq_in/cqc, create_qp_in/qpc/ads,
// rst2init/init2rtr/rtr2rts_qp_in, qp_2err/2rst_in, query_qp_in/out, query_hca_cap_in/out,
// cmd_hca_cap, atomic_caps. Offsets are bits from the start of the enclosing structure.
#include "mlx5gda/devx_cmd.h"

#include <stdexcept>
#include <string>

namespace pyep {
namespace devx {

namespace {

// Common command header.
constexpr Field kOpcode{0x00, 16};
constexpr Field kOpMod{0x30, 16};
constexpr Field kInQpn{0x48, 24};          // qpn in modify/2err/2rst/query_qp
constexpr Field kOptParamMask{0x80, 32};
constexpr uint32_t kQpcInModify = 0xc0;    // qpc inside create_qp_in / *_qp_in / query_qp_out
constexpr Field kOutStatus{0x00, 8};
constexpr Field kOutSyndrome{0x20, 32};
constexpr Field kOutObjId{0x48, 24};

// create_qp_in after the qpc.
constexpr Field kWqUmemOffset{0x800, 64};
constexpr Field kWqUmemId{0x840, 32};
constexpr Field kWqUmemValid{0x860, 1};

// qpc.
constexpr Field kQpcState{0x00, 4};
constexpr Field kQpcSt{0x08, 8};
constexpr Field kQpcPmState{0x13, 2};
constexpr Field kQpcPd{0x28, 24};
constexpr Field kQpcMtu{0x40, 3};
constexpr Field kQpcLogMsgMax{0x43, 5};
constexpr Field kQpcLogRqSize{0x49, 4};
constexpr Field kQpcLogRqStride{0x4d, 3};
constexpr Field kQpcNoSq{0x50, 1};
constexpr Field kQpcLogSqSize{0x51, 4};
constexpr Field kQpcTsFormat{0x58, 2};
constexpr Field kQpcUarPage{0x68, 24};
constexpr Field kQpcUserIndex{0x88, 24};
constexpr Field kQpcLogPageSize{0xa3, 5};
constexpr Field kQpcRemoteQpn{0xa8, 24};
constexpr uint32_t kQpcPrimaryPath = 0xc0;
constexpr Field kQpcLogAckReqFreq{0x380, 4};
constexpr Field kQpcLogSraMax{0x388, 3};
constexpr Field kQpcRetryCount{0x38d, 3};
constexpr Field kQpcRnrRetry{0x390, 3};
constexpr Field kQpcNextSendPsn{0x3c8, 24};
constexpr Field kQpcCqnSnd{0x3e8, 24};
constexpr Field kQpcLogRraMax{0x488, 3};
constexpr Field kQpcAtomicMode{0x48c, 4};
constexpr Field kQpcRre{0x490, 1};
constexpr Field kQpcRwe{0x491, 1};
constexpr Field kQpcRae{0x492, 1};
constexpr Field kQpcMinRnrNak{0x4a3, 5};
constexpr Field kQpcNextRcvPsn{0x4a8, 24};
constexpr Field kQpcCqnRcv{0x4e8, 24};
constexpr Field kQpcDbrAddr{0x500, 64};
constexpr Field kQpcRqType{0x565, 3};
constexpr Field kQpcDbrUmemValid{0x683, 1};
constexpr Field kQpcDbrUmemId{0x720, 32};

// ads (address path), relative to its start.
constexpr Field kAdsPkeyIndex{0x10, 16};
constexpr Field kAdsGrh{0x28, 1};
constexpr Field kAdsRlid{0x30, 16};
constexpr Field kAdsAckTimeout{0x40, 5};
constexpr Field kAdsSrcAddrIndex{0x48, 8};
constexpr Field kAdsHopLimit{0x58, 8};
constexpr Field kAdsTclass{0x64, 8};
constexpr Field kAdsFlowLabel{0x6c, 20};
constexpr uint32_t kAdsRgid = 0x80;        // 16 bytes
constexpr Field kAdsUdpSport{0x110, 16};
constexpr Field kAdsEthPrio{0x121, 3};
constexpr Field kAdsSl{0x124, 4};
constexpr Field kAdsVhcaPortNum{0x128, 8};
constexpr uint32_t kAdsRmac = 0x130;       // 6 bytes: rmac_47_32 then rmac_31_0

// create_cq_in: cqc at 0x80, then the CQ buffer's UMEM.
constexpr uint32_t kCqcInCreate = 0x80;
constexpr Field kCqcDbrUmemValid{0x06, 1};
constexpr Field kCqcCqeSz{0x08, 3};
constexpr Field kCqcCc{0x0b, 1};
constexpr Field kCqcOi{0x0e, 1};
constexpr Field kCqcDbrUmemId{0x20, 32};
constexpr Field kCqcLogCqSize{0x63, 5};
constexpr Field kCqcUarPage{0x68, 24};
constexpr Field kCqcEqn{0xa0, 32};         // c_eqn (8 bits in old layouts, the low bits of this word)
constexpr Field kCqcLogPageSize{0xc3, 5};
constexpr Field kCqcDbrAddr{0x1c0, 64};
constexpr Field kCqUmemOffset{0x280, 64};
constexpr Field kCqUmemId{0x2c0, 32};
constexpr Field kCqUmemValid{0x2e0, 1};

// query_hca_cap_out: capability page at 0x80. cmd_hca_cap / atomic_caps fields relative to it.
constexpr uint32_t kCapPage = 0x80;
constexpr Field kCapLogMaxQpSz{0x88, 8};
constexpr Field kCapLogMaxQp{0x9b, 5};
constexpr Field kCapLogMaxCqSz{0xc8, 8};
constexpr Field kCapLogMaxCq{0xdb, 5};
constexpr Field kCapLogMaxRaReqQp{0x14a, 6};
constexpr Field kCapLogMaxRaResQp{0x15a, 6};
constexpr Field kCapPortType{0x1b6, 2};
constexpr Field kCapNumPorts{0x1b8, 8};
constexpr Field kCapLogMaxMsg{0x1c3, 5};
constexpr Field kCapCqeVersion{0x1fc, 4};
constexpr Field kCapRoce{0x21d, 1};
constexpr Field kCapAtomic{0x21e, 1};
constexpr Field kCapRc{0x23f, 1};
constexpr Field kCapUar4k{0x240, 1};
constexpr Field kCapUmemUid0{0x252, 1};
constexpr Field kCapLogBfRegSize{0x26b, 5};
constexpr Field kCapLogMaxPd{0x32b, 5};
constexpr Field kCapSqTsFormat{0x440, 2};
constexpr Field kAtomicReq8BEndianness{0x40, 2};
constexpr Field kAtomicOperations{0x90, 16};
constexpr Field kAtomicSizeQp{0xb0, 16};

struct Box {
    Bytes b;
    explicit Box(size_t n) : b(n, 0) {}
    void set(Field f, uint64_t v, uint32_t base = 0, const char* name = "field") {
        try {
            set_field(b.data(), b.size(), base + f.off, f.width, v);
        } catch (const std::invalid_argument& e) {
            throw std::invalid_argument(std::string(name) + ": " + e.what());
        }
    }
};

void check_range(const char* name, uint64_t v, uint64_t lo, uint64_t hi) {
    if (v < lo || v > hi) {
        throw std::invalid_argument(std::string(name) + "=" + std::to_string(v) + " is outside [" +
                                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
}

void header(Box& m, uint16_t opcode, uint16_t op_mod = 0) {
    m.set(kOpcode, opcode);
    m.set(kOpMod, op_mod);
}

Bytes qpn_only(uint16_t opcode, uint32_t qpn) {
    Box m(kQpnOnlyInBytes);
    header(m, opcode);
    m.set(kInQpn, qpn, 0, "qpn");
    return m.b;
}

void need(size_t len, size_t want, const char* what) {
    if (len < want) {
        throw std::invalid_argument(std::string(what) + " output is " + std::to_string(len) +
                                    " bytes, needs at least " + std::to_string(want));
    }
}

}  // namespace

void set_field(uint8_t* buf, size_t len, uint32_t bit_off, uint32_t width, uint64_t value) {
    if (width == 0 || width > 64) throw std::invalid_argument("field width " + std::to_string(width) + " not in 1..64");
    if ((uint64_t)bit_off + width > (uint64_t)len * 8) {
        throw std::invalid_argument("field at bit " + std::to_string(bit_off) + " width " + std::to_string(width) +
                                    " exceeds the " + std::to_string(len) + "-byte mailbox");
    }
    if (width < 64 && (value >> width) != 0) {
        throw std::invalid_argument("value " + std::to_string(value) + " does not fit in " + std::to_string(width) +
                                    " bits");
    }
    // Bit i of the field (i = 0 its most significant) sits at big-endian bit bit_off + i of the mailbox.
    for (uint32_t i = 0; i < width; ++i) {
        const uint32_t bit = bit_off + i;
        const uint8_t mask = (uint8_t)(0x80u >> (bit & 7));
        if ((value >> (width - 1 - i)) & 1) buf[bit >> 3] |= mask;
        else buf[bit >> 3] &= (uint8_t)~mask;
    }
}

uint64_t get_field(const uint8_t* buf, size_t len, uint32_t bit_off, uint32_t width) {
    if (width == 0 || width > 64) throw std::invalid_argument("field width " + std::to_string(width) + " not in 1..64");
    if ((uint64_t)bit_off + width > (uint64_t)len * 8) {
        throw std::invalid_argument("field at bit " + std::to_string(bit_off) + " width " + std::to_string(width) +
                                    " exceeds the " + std::to_string(len) + "-byte mailbox");
    }
    uint64_t v = 0;
    for (uint32_t i = 0; i < width; ++i) {
        const uint32_t bit = bit_off + i;
        v = (v << 1) | ((buf[bit >> 3] >> (7 - (bit & 7))) & 1u);
    }
    return v;
}

void set_bytes(uint8_t* buf, size_t len, uint32_t bit_off, const uint8_t* src, size_t n) {
    if (bit_off % 8) throw std::invalid_argument("byte array at bit " + std::to_string(bit_off) + " is not byte aligned");
    if (bit_off / 8 + n > len) throw std::invalid_argument("byte array exceeds the mailbox");
    for (size_t i = 0; i < n; ++i) buf[bit_off / 8 + i] = src[i];
}

uint8_t mtu_enum(uint32_t bytes) {
    switch (bytes) {
        case 256: return 1;
        case 512: return 2;
        case 1024: return 3;
        case 2048: return 4;
        case 4096: return 5;
        default:
            throw std::invalid_argument("mtu=" + std::to_string(bytes) + " is not one of 256, 512, 1024, 2048, 4096");
    }
}

uint32_t mtu_bytes(uint8_t e) {
    if (e < 1 || e > 5) throw std::invalid_argument("mtu enum " + std::to_string(e) + " is not in 1..5");
    return 128u << e;
}

uint8_t atomic_mode_for(uint16_t atomic_size_qp) {
    int top = -1;
    for (int b = 15; b >= 0; --b) {
        if (atomic_size_qp & (1u << b)) { top = b; break; }
    }
    if (top < 2) return 0;
    if (top == 2) return 2;
    return (uint8_t)(top > 15 ? 15 : top);
}

Bytes encode_create_cq(const CreateCqParams& p) {
    check_range("log_cq_size", p.log_cq_size, 0, 24);
    if (p.dbr_offset % 8) throw std::invalid_argument("dbr_offset must be 8-byte aligned");
    Box m(kCreateCqInBytes);
    header(m, kCmdCreateCq);
    const uint32_t c = kCqcInCreate;
    m.set(kCqcDbrUmemValid, 1, c);
    m.set(kCqcCqeSz, 0, c);  // 64-byte CQEs: the layout qp.h polls
    m.set(kCqcCc, p.collapsed ? 1 : 0, c);
    m.set(kCqcOi, p.overrun_ignore ? 1 : 0, c);
    m.set(kCqcDbrUmemId, p.dbr_umem_id, c, "dbr_umem_id");
    m.set(kCqcLogCqSize, p.log_cq_size, c, "log_cq_size");
    m.set(kCqcUarPage, p.uar_page, c, "uar_page");
    m.set(kCqcEqn, p.eqn, c, "eqn");
    m.set(kCqcLogPageSize, p.log_page_size, c, "log_page_size");
    m.set(kCqcDbrAddr, p.dbr_offset, c, "dbr_offset");
    m.set(kCqUmemOffset, p.cq_umem_offset, 0, "cq_umem_offset");
    m.set(kCqUmemId, p.cq_umem_id, 0, "cq_umem_id");
    m.set(kCqUmemValid, 1);
    return m.b;
}

Bytes encode_create_qp(const CreateQpParams& p) {
    check_range("log_sq_size", p.log_sq_size, 0, 15);
    if (p.dbr_offset % 8) throw std::invalid_argument("dbr_offset must be 8-byte aligned");
    check_range("ts_format", p.ts_format, 0, 2);
    Box m(kCreateQpInBytes);
    header(m, kCmdCreateQp);
    const uint32_t q = kQpcInModify;
    m.set(kQpcSt, kQpcStRc, q);
    m.set(kQpcPmState, kQpcPmMigrated, q);
    m.set(kQpcPd, p.pd, q, "pd");
    m.set(kQpcLogMsgMax, p.log_msg_max, q, "log_msg_max");
    m.set(kQpcLogRqSize, 0, q);
    m.set(kQpcLogRqStride, 0, q);
    m.set(kQpcNoSq, 0, q);
    m.set(kQpcLogSqSize, p.log_sq_size, q, "log_sq_size");
    m.set(kQpcTsFormat, p.ts_format, q, "ts_format");
    m.set(kQpcUarPage, p.uar_page, q, "uar_page");
    m.set(kQpcUserIndex, p.user_index, q, "user_index");
    m.set(kQpcLogPageSize, p.log_page_size, q, "log_page_size");
    m.set(kQpcCqnSnd, p.cqn_snd, q, "cqn_snd");
    m.set(kQpcCqnRcv, p.cqn_rcv, q, "cqn_rcv");
    m.set(kQpcDbrAddr, p.dbr_offset, q, "dbr_offset");
    m.set(kQpcRqType, kRqZeroLen, q);
    m.set(kQpcDbrUmemValid, 1, q);
    m.set(kQpcDbrUmemId, p.dbr_umem_id, q, "dbr_umem_id");
    m.set(kWqUmemOffset, p.wq_umem_offset, 0, "wq_umem_offset");
    m.set(kWqUmemId, p.wq_umem_id, 0, "wq_umem_id");
    m.set(kWqUmemValid, 1);
    return m.b;
}

Bytes encode_rst2init(const Rst2InitParams& p) {
    check_range("port", p.port, 1, 255);
    Box m(kModifyQpInBytes);
    header(m, kCmdRst2InitQp);
    m.set(kInQpn, p.qpn, 0, "qpn");
    m.set(kOptParamMask, 0);
    const uint32_t q = kQpcInModify;
    const uint32_t path = q + kQpcPrimaryPath;
    m.set(kQpcPmState, kQpcPmMigrated, q);
    m.set(kQpcRre, p.remote_read, q);
    m.set(kQpcRwe, p.remote_write, q);
    m.set(kQpcRae, p.remote_atomic, q);
    m.set(kQpcAtomicMode, p.atomic_mode, q, "atomic_mode");
    m.set(kAdsVhcaPortNum, p.port, path, "port");
    m.set(kAdsPkeyIndex, p.pkey_index, path, "pkey_index");
    return m.b;
}

Bytes encode_init2rtr(const Init2RtrParams& p) {
    check_range("port", p.port, 1, 255);
    check_range("min_rnr_nak", p.min_rnr_nak, 0, 31);
    Box m(kModifyQpInBytes);
    header(m, kCmdInit2RtrQp);
    m.set(kInQpn, p.qpn, 0, "qpn");
    m.set(kOptParamMask, 0);
    const uint32_t q = kQpcInModify;
    const uint32_t path = q + kQpcPrimaryPath;
    m.set(kQpcMtu, mtu_enum(p.mtu), q);
    m.set(kQpcLogMsgMax, p.log_msg_max, q, "log_msg_max");
    m.set(kQpcRemoteQpn, p.remote_qpn, q, "remote_qpn");
    m.set(kQpcNextRcvPsn, p.next_rcv_psn, q, "next_rcv_psn");
    m.set(kQpcMinRnrNak, p.min_rnr_nak, q, "min_rnr_nak");
    m.set(kQpcLogRraMax, p.log_rra_max, q, "log_rra_max");
    m.set(kAdsVhcaPortNum, p.port, path, "port");
    if (p.roce) {
        // RoCE always carries a GRH; the SL is expressed as the Ethernet priority.
        m.set(kAdsGrh, 1, path);
        m.set(kAdsEthPrio, p.sl, path, "sl (RoCE priority, 0..7)");
        set_bytes(m.b.data(), m.b.size(), path + kAdsRmac, p.rmac, 6);
        m.set(kAdsUdpSport, p.udp_sport, path, "udp_sport");
    } else {
        m.set(kAdsRlid, p.rlid, path, "rlid");
        m.set(kAdsSl, p.sl, path, "sl");
        m.set(kAdsGrh, p.grh ? 1 : 0, path);
    }
    if (p.roce || p.grh) {
        set_bytes(m.b.data(), m.b.size(), path + kAdsRgid, p.rgid, 16);
        m.set(kAdsSrcAddrIndex, p.src_addr_index, path, "src_addr_index");
        m.set(kAdsHopLimit, p.hop_limit, path, "hop_limit");
        m.set(kAdsTclass, p.traffic_class, path, "traffic_class");
        m.set(kAdsFlowLabel, p.flow_label, path, "flow_label");
    }
    return m.b;
}

Bytes encode_rtr2rts(const Rtr2RtsParams& p) {
    Box m(kModifyQpInBytes);
    header(m, kCmdRtr2RtsQp);
    m.set(kInQpn, p.qpn, 0, "qpn");
    m.set(kOptParamMask, 0);
    const uint32_t q = kQpcInModify;
    m.set(kQpcLogAckReqFreq, p.log_ack_req_freq, q, "log_ack_req_freq");
    m.set(kQpcLogSraMax, p.log_sra_max, q, "log_sra_max");
    m.set(kQpcRetryCount, p.retry_count, q, "retry_count");
    m.set(kQpcRnrRetry, p.rnr_retry, q, "rnr_retry");
    m.set(kQpcNextSendPsn, p.next_send_psn, q, "next_send_psn");
    m.set(kAdsAckTimeout, p.ack_timeout, q + kQpcPrimaryPath, "ack_timeout");
    return m.b;
}

Bytes encode_qp_2err(uint32_t qpn) { return qpn_only(kCmd2ErrQp, qpn); }
Bytes encode_qp_2rst(uint32_t qpn) { return qpn_only(kCmd2RstQp, qpn); }
Bytes encode_query_qp(uint32_t qpn) { return qpn_only(kCmdQueryQp, qpn); }

Bytes encode_query_hca_cap(uint16_t cap_type, bool current) {
    check_range("cap_type", cap_type, 0, 0x7fff);
    Box m(kQueryHcaCapInBytes);
    header(m, kCmdQueryHcaCap, (uint16_t)((cap_type << 1) | (current ? 1 : 0)));
    return m.b;
}

CmdStatus parse_status(const uint8_t* out, size_t len) {
    need(len, 8, "command");
    CmdStatus s;
    s.status = (uint8_t)get_field(out, len, kOutStatus.off, kOutStatus.width);
    s.syndrome = (uint32_t)get_field(out, len, kOutSyndrome.off, kOutSyndrome.width);
    return s;
}

std::string status_name(uint8_t status) {
    switch (status) {
        case 0x0: return "OK";
        case 0x1: return "INT_ERR";
        case 0x2: return "BAD_OP";
        case 0x3: return "BAD_PARAM";
        case 0x4: return "BAD_SYS_STATE";
        case 0x5: return "BAD_RESOURCE";
        case 0x6: return "RESOURCE_BUSY";
        case 0x8: return "EXCEED_LIM";
        case 0x9: return "BAD_RES_STATE";
        case 0xa: return "BAD_INDEX";
        case 0xf: return "NO_RESOURCES";
        case 0x10: return "BAD_QP_STATE";
        case 0x30: return "BAD_PKT";
        case 0x40: return "BAD_SIZE_OUTS_CQES";
        case 0x50: return "BAD_INPUT_LEN";
        case 0x51: return "BAD_OUTPUT_LEN";
        default: return "status 0x" + std::to_string(status);
    }
}

uint32_t parse_created_id(const uint8_t* out, size_t len) {
    need(len, kCmdOutHdrBytes, "create");
    return (uint32_t)get_field(out, len, kOutObjId.off, kOutObjId.width);
}

uint8_t parse_query_qp_state(const uint8_t* out, size_t len) {
    need(len, kQpcInModify / 8 + 1, "QUERY_QP");
    return (uint8_t)get_field(out, len, kQpcInModify + kQpcState.off, kQpcState.width);
}

HcaCaps parse_hca_caps(const uint8_t* g, size_t glen, const uint8_t* a, size_t alen) {
    need(glen, kQueryHcaCapOutBytes, "QUERY_HCA_CAP(general)");
    auto gf = [&](Field f) { return (uint32_t)get_field(g, glen, kCapPage + f.off, f.width); };
    HcaCaps c;
    c.log_max_qp_sz = gf(kCapLogMaxQpSz);
    c.log_max_qp = gf(kCapLogMaxQp);
    c.log_max_cq_sz = gf(kCapLogMaxCqSz);
    c.log_max_cq = gf(kCapLogMaxCq);
    c.log_max_ra_req_qp = gf(kCapLogMaxRaReqQp);
    c.log_max_ra_res_qp = gf(kCapLogMaxRaResQp);
    c.port_type = gf(kCapPortType);
    c.num_ports = gf(kCapNumPorts);
    c.log_max_msg = gf(kCapLogMaxMsg);
    c.cqe_version = gf(kCapCqeVersion);
    c.roce = gf(kCapRoce);
    c.atomic = gf(kCapAtomic);
    c.rc = gf(kCapRc);
    c.uar_4k = gf(kCapUar4k);
    c.umem_uid_0 = gf(kCapUmemUid0);
    c.log_bf_reg_size = gf(kCapLogBfRegSize);
    c.log_max_pd = gf(kCapLogMaxPd);
    c.sq_ts_format = gf(kCapSqTsFormat);
    if (c.atomic && alen) {
        need(alen, kQueryHcaCapOutBytes, "QUERY_HCA_CAP(atomic)");
        auto af = [&](Field f) { return (uint32_t)get_field(a, alen, kCapPage + f.off, f.width); };
        c.atomic_operations = af(kAtomicOperations);
        c.atomic_size_qp = af(kAtomicSizeQp);
        c.atomic_req_8b_endianness_mode = af(kAtomicReq8BEndianness);
    }
    c.fetch_add_64 = c.atomic && (c.atomic_operations & kAtomicOpFetchAdd) && (c.atomic_size_qp & kAtomicSize8B);
    c.masked_fetch_add_32 =
        c.atomic && (c.atomic_operations & kAtomicOpMaskedFetchAdd) && (c.atomic_size_qp & kAtomicSize4B);
    return c;
}

}  // namespace devx
}  // namespace pyep
