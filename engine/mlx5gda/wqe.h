// WQE encoding and decoding: the one place pyep turns a work request into mlx5 send-WQE bytes.
//
// Every WQE pyep posts fits in one 64-byte WQEBB:
//   NOP          ctrl                          ds = 1
//   RDMA_WRITE   ctrl | raddr | data           ds = 3
//   MASKED_FA32  ctrl | raddr | ext-atomic | data(4 B fetch)   ds = 4   (opmod 0x08)
//   FA64         ctrl | raddr | atomic     | data(8 B fetch)   ds = 4
// The builder assembles the WQEBB in registers and writes it as four 16-byte stores, which on the GPU
// become st.v4 instructions (one 16-byte transaction each) instead of a dozen narrow stores.
#pragma once

#include "mlx5gda/portable.h"
#include "mlx5gda/prm.h"

namespace pyep {
namespace gda {

struct WorkRequest {
    uint8_t opcode = prm::kOpNop;  // prm::Opcode
    bool signaled = false;         // sets MLX5_WQE_CTRL_CQ_UPDATE
    bool fence = false;            // MLX5_WQE_CTRL_FENCE: wait for earlier RDMA reads/atomics
    uint64_t laddr = 0;            // local buffer (write source / atomic fetch destination)
    uint32_t lkey = 0;
    uint64_t raddr = 0;            // remote address
    uint32_t rkey = 0;
    uint32_t length = 0;           // RDMA_WRITE bytes
    uint64_t add = 0;              // atomic addend (32-bit ops use the low 32 bits)
};

// Four 16-byte words = one WQEBB.
struct alignas(16) WqeWords {
    uint32_t w[16];
};

PYEP_HD uint8_t wqe_ds(uint8_t opcode) {
    switch (opcode) {
        case prm::kOpNop: return 1;
        case prm::kOpRdmaWrite: return 3;
        case prm::kOpAtomicMaskedFa:
        case prm::kOpAtomicFa: return 4;
        default: return 0;  // not an opcode pyep posts
    }
}

// WQEBBs a WQE of `ds` 16-byte segments occupies.
PYEP_HD uint32_t wqebbs_for_ds(uint32_t ds) { return (ds * prm::kSegBytes + prm::kSendWqeBB - 1) / prm::kSendWqeBB; }

// Builds the WQEBB for `wr` at producer index `wqe_index` of QP `qpn`. Returns ds, or 0 when the
// opcode is not one pyep posts (the caller must reject it).
PYEP_HD uint8_t encode_wqe(const WorkRequest& wr, uint16_t wqe_index, uint32_t qpn, WqeWords* out) {
    const uint8_t ds = wqe_ds(wr.opcode);
    if (ds == 0) return 0;
    for (int i = 0; i < 16; ++i) out->w[i] = 0;
    const uint8_t opmod = wr.opcode == prm::kOpAtomicMaskedFa ? prm::kOpmodExtAtomic4B : 0;
    const uint8_t flags = (wr.signaled ? prm::kCtrlCqUpdate : 0) | (wr.fence ? prm::kCtrlFence : 0);
    // ctrl: opmod_idx_opcode, qpn_ds, {signature, dci_stream_channel_id[2], fm_ce_se}, imm.
    out->w[0] = htobe32_(((uint32_t)opmod << 24) | ((uint32_t)wqe_index << 8) | wr.opcode);
    out->w[1] = htobe32_((qpn << 8) | ds);
    out->w[2] = (uint32_t)flags << 24;  // fm_ce_se is byte 11 (little-endian word: top byte)
    out->w[3] = 0;
    if (wr.opcode == prm::kOpNop) return ds;
    // raddr seg
    const uint64_t raddr_be = htobe64_(wr.raddr);
    out->w[4] = (uint32_t)raddr_be;
    out->w[5] = (uint32_t)(raddr_be >> 32);
    out->w[6] = htobe32_(wr.rkey);
    out->w[7] = 0;
    uint32_t data_word = 8;
    uint32_t data_len = wr.length;
    if (wr.opcode == prm::kOpAtomicMaskedFa) {
        out->w[8] = htobe32_((uint32_t)wr.add);  // add_data; field_boundary = 0: one 32-bit add
        data_word = 12;
        data_len = 4;
    } else if (wr.opcode == prm::kOpAtomicFa) {
        const uint64_t add_be = htobe64_(wr.add);
        out->w[8] = (uint32_t)add_be;
        out->w[9] = (uint32_t)(add_be >> 32);
        data_word = 12;
        data_len = 8;
    }
    const uint64_t laddr_be = htobe64_(wr.laddr);
    out->w[data_word + 0] = htobe32_(data_len);
    out->w[data_word + 1] = htobe32_(wr.lkey);
    out->w[data_word + 2] = (uint32_t)laddr_be;
    out->w[data_word + 3] = (uint32_t)(laddr_be >> 32);
    return ds;
}

// Writes an encoded WQEBB to ring memory with 16-byte stores.
PYEP_HD void store_wqebb(void* dst, const WqeWords& words) {
#if defined(__CUDA_ARCH__)
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(&words);
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = s[i];
#else
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int i = 0; i < 16; ++i) d[i] = words.w[i];
#endif
}

// --- decoding (softnic execution, diagnostics) -------------------------------------------------------
struct DecodedWqe {
    uint8_t opcode, opmod, ds, fm_ce_se, signature;
    uint16_t wqe_index;
    uint32_t qpn, imm;
    WorkRequest wr;           // addresses, keys, length, addend as posted
    uint32_t field_boundary;  // masked FA32
    uint64_t compare;         // FA64 atomic seg
};

PYEP_HD DecodedWqe decode_wqe(const void* wqebb) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wqebb);
    DecodedWqe d{};
    const uint32_t oio = be32toh_(w[0]);
    d.opcode = (uint8_t)(oio & 0xff);
    d.wqe_index = (uint16_t)((oio >> 8) & 0xffff);
    d.opmod = (uint8_t)(oio >> 24);
    const uint32_t qds = be32toh_(w[1]);
    d.qpn = qds >> 8;
    d.ds = (uint8_t)(qds & 0x3f);
    d.signature = (uint8_t)(w[2] & 0xff);
    d.fm_ce_se = (uint8_t)(w[2] >> 24);
    d.imm = be32toh_(w[3]);
    d.wr.opcode = d.opcode;
    d.wr.signaled = (d.fm_ce_se & prm::kCtrlCqUpdate) != 0;
    d.wr.fence = (d.fm_ce_se & prm::kCtrlFence) != 0;
    if (d.ds < 2) return d;
    d.wr.raddr = be64toh_(((uint64_t)w[5] << 32) | w[4]);
    d.wr.rkey = be32toh_(w[6]);
    uint32_t data_word = 8;
    if (d.opcode == prm::kOpAtomicMaskedFa) {
        d.wr.add = be32toh_(w[8]);
        d.field_boundary = be32toh_(w[9]);
        data_word = 12;
    } else if (d.opcode == prm::kOpAtomicFa || d.opcode == prm::kOpAtomicCs) {
        d.wr.add = be64toh_(((uint64_t)w[9] << 32) | w[8]);
        d.compare = be64toh_(((uint64_t)w[11] << 32) | w[10]);
        data_word = 12;
    }
    if (d.ds * prm::kSegBytes >= (data_word + 4) * 4) {
        d.wr.length = be32toh_(w[data_word + 0]);
        d.wr.lkey = be32toh_(w[data_word + 1]);
        d.wr.laddr = be64toh_(((uint64_t)w[data_word + 3] << 32) | w[data_word + 2]);
    }
    return d;
}

// A CQE in words: what completed, and if it failed, why.
struct DecodedCqe {
    uint8_t opcode;           // prm::CqeOpcode (op_own >> 4)
    uint8_t owner;            // op_own & 1
    uint8_t syndrome;         // error CQEs only
    uint8_t vendor_syndrome;  // error CQEs only
    uint8_t wqe_opcode;       // s_wqe_opcode: top byte of sop_drop_qpn
    uint16_t wqe_counter;
    uint32_t qpn;
    uint32_t byte_cnt;
};

PYEP_HD DecodedCqe decode_cqe(const void* cqe64) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(cqe64);
    const prm::Cqe64* c = reinterpret_cast<const prm::Cqe64*>(cqe64);
    DecodedCqe d{};
    d.opcode = (uint8_t)(c->op_own >> 4);
    d.owner = (uint8_t)(c->op_own & prm::kCqeOwnerMask);
    const uint32_t sdq = be32toh_(c->sop_drop_qpn);
    d.wqe_opcode = (uint8_t)(sdq >> 24);
    d.qpn = sdq & 0xffffff;
    d.wqe_counter = be16toh_(c->wqe_counter);
    d.byte_cnt = be32toh_(c->byte_cnt);
    if (d.opcode == prm::kCqeReqErr || d.opcode == prm::kCqeRespErr) {
        d.syndrome = b[prm::kErrCqeSyndromeOffset];
        d.vendor_syndrome = b[prm::kErrCqeVendorSyndOffset];
    }
    return d;
}

// Fills a CQE as the NIC would (softnic). The op_own byte, which hands the entry to software, is
// written last and with release semantics by the caller (see softnic), never here.
PYEP_HD void encode_cqe_body(void* cqe64, const DecodedCqe& d) {
    uint8_t* b = reinterpret_cast<uint8_t*>(cqe64);
    for (int i = 0; i < 63; ++i) b[i] = 0;
    prm::Cqe64* c = reinterpret_cast<prm::Cqe64*>(cqe64);
    c->byte_cnt = htobe32_(d.byte_cnt);
    c->sop_drop_qpn = htobe32_(((uint32_t)d.wqe_opcode << 24) | (d.qpn & 0xffffff));
    c->wqe_counter = htobe16_(d.wqe_counter);
    if (d.opcode == prm::kCqeReqErr || d.opcode == prm::kCqeRespErr) {
        b[prm::kErrCqeSyndromeOffset] = d.syndrome;
        b[prm::kErrCqeVendorSyndOffset] = d.vendor_syndrome;
    }
}
PYEP_HD uint8_t cqe_op_own(uint8_t cqe_opcode, uint8_t owner) { return (uint8_t)((cqe_opcode << 4) | (owner & 1)); }

}  // namespace gda
}  // namespace pyep
