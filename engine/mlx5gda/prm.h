// mlx5 PRM structures and constants of the data path used by pyep -- WQE segments, CQEs, the doorbell
// record, opcodes, syndromes -- the one place they are defined. The DevX command mailboxes
// (mlx5_ifc layouts used only by host setup) are in devx_cmd.h.
//
// Authority: rdma-core's infiniband/mlx5dv.h (names in comments are its names). Everything on the wire
// and in the rings is big-endian; these structs hold raw bytes and are filled through wqe.h, never by
// assigning host-order values. Where rdma-core's header is available to a host build, the sizes and
// offsets below are static-asserted against it (PYEP_HAVE_RDMA_CORE, see the end of this file).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace pyep {
namespace prm {

// --- Send WQE building block and segments --------------------------------------------------------
constexpr uint32_t kSendWqeBB = 64;   // MLX5_SEND_WQE_BB
constexpr uint32_t kSegBytes = 16;    // ds counts 16-byte units ("octowords")
constexpr uint32_t kSendDbr = 1;      // MLX5_SND_DBR: send counter is the 2nd be32 of the DBR
constexpr uint32_t kRecvDbr = 0;      // MLX5_RCV_DBR

// Send opcodes (MLX5_OPCODE_*).
enum Opcode : uint8_t {
    kOpNop = 0x00,
    kOpRdmaWrite = 0x08,
    kOpRdmaWriteImm = 0x09,
    kOpSend = 0x0a,
    kOpRdmaRead = 0x10,
    kOpAtomicCs = 0x11,
    kOpAtomicFa = 0x12,
    kOpAtomicMaskedCs = 0x14,
    kOpAtomicMaskedFa = 0x15,
};

// opmod of the extended ("masked") atomics: 0x08 | log2(operand bytes) - 2. A 4-byte operand is 0x08,
// an 8-byte one 0x09. This is how a 32-bit fetch-add is expressed; plain ATOMIC_FA is 64-bit only.
constexpr uint8_t kOpmodExtAtomic4B = 0x08;
constexpr uint8_t kOpmodExtAtomic8B = 0x09;

// ctrl.fm_ce_se bits (MLX5_WQE_CTRL_*).
enum CtrlFlags : uint8_t {
    kCtrlSolicited = 1 << 1,          // MLX5_WQE_CTRL_SOLICITED
    kCtrlCqUpdate = 2 << 2,           // MLX5_WQE_CTRL_CQ_UPDATE: generate a CQE for this WQE
    kCtrlSmallFence = 1 << 5,         // MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE
    kCtrlFence = 4 << 5,              // MLX5_WQE_CTRL_FENCE
};

// struct mlx5_wqe_ctrl_seg (16 B).
struct alignas(4) CtrlSeg {
    uint32_t opmod_idx_opcode;  // be32: opmod<<24 | wqe_index<<8 | opcode
    uint32_t qpn_ds;            // be32: qpn<<8 | ds
    uint8_t signature;
    uint8_t dci_stream_channel_id[2];
    uint8_t fm_ce_se;
    uint32_t imm;               // be32 (or raw, per opcode)
};

// struct mlx5_wqe_raddr_seg (16 B).
struct alignas(8) RaddrSeg {
    uint64_t raddr;             // be64
    uint32_t rkey;              // be32
    uint32_t reserved;
};

// struct mlx5_wqe_data_seg (16 B).
struct alignas(8) DataSeg {
    uint32_t byte_count;        // be32
    uint32_t lkey;              // be32
    uint64_t addr;              // be64
};

// struct mlx5_wqe_atomic_seg (16 B): 64-bit ATOMIC_FA / ATOMIC_CS.
struct alignas(8) AtomicSeg {
    uint64_t swap_add;          // be64
    uint64_t compare;           // be64
};

// Extended atomic segment for a 4-byte masked fetch-add (opcode ATOMIC_MASKED_FA, opmod 0x08).
// field_boundary is a bit mask of carry boundaries inside the operand; 0 = one plain 32-bit add.
struct alignas(8) MaskedFa32Seg {
    uint32_t add_data;          // be32
    uint32_t field_boundary;    // be32
    uint64_t reserved;
};

// The WQEs pyep posts all fit one WQEBB: ctrl + raddr + (atomic) + data <= 4 segments.
struct alignas(64) WqeBB {
    uint8_t bytes[kSendWqeBB];
};

// --- Completion queue entry ------------------------------------------------------------------------
enum CqeOpcode : uint8_t {
    kCqeReq = 0,       // MLX5_CQE_REQ
    kCqeRespWrImm = 1,
    kCqeRespSend = 2,
    kCqeReqErr = 13,   // MLX5_CQE_REQ_ERR
    kCqeRespErr = 14,  // MLX5_CQE_RESP_ERR
    kCqeInvalid = 15,  // MLX5_CQE_INVALID: what software pre-sets every CQE to
};

enum CqeSyndrome : uint8_t {  // MLX5_CQE_SYNDROME_*
    kSyndLocalLengthErr = 0x01,
    kSyndLocalQpOpErr = 0x02,
    kSyndLocalProtErr = 0x04,
    kSyndWrFlushErr = 0x05,
    kSyndMwBindErr = 0x06,
    kSyndBadRespErr = 0x10,
    kSyndLocalAccessErr = 0x11,
    kSyndRemoteInvalReqErr = 0x12,
    kSyndRemoteAccessErr = 0x13,
    kSyndRemoteOpErr = 0x14,
    kSyndTransportRetryExcErr = 0x15,
    kSyndRnrRetryExcErr = 0x16,
    kSyndRemoteAbortedErr = 0x22,
};

constexpr uint32_t kCqeBytes = 64;
constexpr uint8_t kCqeOwnerMask = 1;  // MLX5_CQE_OWNER_MASK

// struct mlx5_cqe64 (64 B), requester view. Error CQEs (struct mlx5_err_cqe) overlay bytes 54/55 with
// vendor_err_synd / syndrome and put the failing WQE's opcode in the top byte of sop_drop_qpn.
struct alignas(64) Cqe64 {
    uint8_t rsvd0[44];
    uint32_t byte_cnt;          // be32, offset 44
    uint64_t timestamp;         // be64, offset 48 (err CQE: bytes 54/55 = vendor_err_synd/syndrome)
    uint32_t sop_drop_qpn;      // be32, offset 56: s_wqe_opcode<<24 | qpn
    uint16_t wqe_counter;       // be16, offset 60
    uint8_t signature;          // offset 62
    uint8_t op_own;             // offset 63: opcode<<4 | ... | owner
};

constexpr uint32_t kErrCqeVendorSyndOffset = 54;  // mlx5_err_cqe.vendor_err_synd
constexpr uint32_t kErrCqeSyndromeOffset = 55;    // mlx5_err_cqe.syndrome

// CQ doorbell record: be32 set_ci (consumer index, 24 bits) then be32 arm.
constexpr uint32_t kCqDbrSetCi = 0;
constexpr uint32_t kCqDbrArm = 1;
constexpr uint32_t kCqCiMask = 0xffffff;

static_assert(sizeof(CtrlSeg) == 16, "ctrl seg");
static_assert(sizeof(RaddrSeg) == 16, "raddr seg");
static_assert(sizeof(DataSeg) == 16, "data seg");
static_assert(sizeof(AtomicSeg) == 16, "atomic seg");
static_assert(sizeof(MaskedFa32Seg) == 16, "masked fa32 seg");
static_assert(sizeof(Cqe64) == 64, "cqe64");
static_assert(offsetof(Cqe64, byte_cnt) == 44 && offsetof(Cqe64, sop_drop_qpn) == 56 &&
              offsetof(Cqe64, wqe_counter) == 60 && offsetof(Cqe64, op_own) == 63, "cqe64 offsets");
static_assert(offsetof(CtrlSeg, fm_ce_se) == 11 && offsetof(CtrlSeg, imm) == 12, "ctrl offsets");

// Access flags of a memory region (IBV_ACCESS_* values, so they can be passed through verbs).
enum Access : uint32_t {
    kAccessLocalWrite = 1,
    kAccessRemoteWrite = 2,
    kAccessRemoteRead = 4,
    kAccessRemoteAtomic = 8,
};

// QP states (the PRM's qp_state encoding in QUERY_QP/MODIFY_QP).
enum QpState : uint8_t {
    kQpsReset = 0x0,
    kQpsInit = 0x1,
    kQpsRtr = 0x2,
    kQpsRts = 0x3,
    kQpsErr = 0x6,
};

}  // namespace prm
}  // namespace pyep

#if defined(PYEP_HAVE_RDMA_CORE) && !defined(__CUDACC__)
#include <infiniband/mlx5dv.h>
namespace pyep {
namespace prm {
namespace rdma_core_check {
// rdma-core's constants are anonymous enums; comparing them with ours is the point.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wenum-compare"
static_assert(sizeof(mlx5_wqe_ctrl_seg) == sizeof(CtrlSeg), "ctrl seg size vs mlx5dv.h");
static_assert(offsetof(mlx5_wqe_ctrl_seg, qpn_ds) == offsetof(CtrlSeg, qpn_ds), "qpn_ds");
static_assert(offsetof(mlx5_wqe_ctrl_seg, signature) == offsetof(CtrlSeg, signature), "signature");
static_assert(offsetof(mlx5_wqe_ctrl_seg, fm_ce_se) == offsetof(CtrlSeg, fm_ce_se), "fm_ce_se");
static_assert(offsetof(mlx5_wqe_ctrl_seg, imm) == offsetof(CtrlSeg, imm), "imm");
static_assert(sizeof(mlx5_wqe_raddr_seg) == sizeof(RaddrSeg), "raddr seg size");
static_assert(offsetof(mlx5_wqe_raddr_seg, rkey) == offsetof(RaddrSeg, rkey), "rkey");
static_assert(sizeof(mlx5_wqe_data_seg) == sizeof(DataSeg), "data seg size");
static_assert(offsetof(mlx5_wqe_data_seg, lkey) == offsetof(DataSeg, lkey), "lkey");
static_assert(offsetof(mlx5_wqe_data_seg, addr) == offsetof(DataSeg, addr), "addr");
static_assert(sizeof(mlx5_wqe_atomic_seg) == sizeof(AtomicSeg), "atomic seg size");
static_assert(offsetof(mlx5_wqe_atomic_seg, compare) == offsetof(AtomicSeg, compare), "compare");
static_assert(sizeof(mlx5_cqe64) == sizeof(Cqe64), "cqe64 size");
static_assert(offsetof(mlx5_cqe64, byte_cnt) == offsetof(Cqe64, byte_cnt), "byte_cnt");
static_assert(offsetof(mlx5_cqe64, sop_drop_qpn) == offsetof(Cqe64, sop_drop_qpn), "sop_drop_qpn");
static_assert(offsetof(mlx5_cqe64, wqe_counter) == offsetof(Cqe64, wqe_counter), "wqe_counter");
static_assert(offsetof(mlx5_cqe64, op_own) == offsetof(Cqe64, op_own), "op_own");
static_assert(offsetof(mlx5_err_cqe, syndrome) == kErrCqeSyndromeOffset, "err syndrome");
static_assert(offsetof(mlx5_err_cqe, vendor_err_synd) == kErrCqeVendorSyndOffset, "vendor synd");
static_assert(offsetof(mlx5_err_cqe, wqe_counter) == offsetof(Cqe64, wqe_counter), "err wqe_counter");
static_assert(MLX5_SEND_WQE_BB == kSendWqeBB && MLX5_SND_DBR == kSendDbr, "WQEBB / DBR index");
static_assert(MLX5_OPCODE_NOP == kOpNop && MLX5_OPCODE_RDMA_WRITE == kOpRdmaWrite &&
              MLX5_OPCODE_ATOMIC_FA == kOpAtomicFa && MLX5_OPCODE_ATOMIC_MASKED_FA == kOpAtomicMaskedFa,
              "opcodes");
static_assert(MLX5_WQE_CTRL_CQ_UPDATE == kCtrlCqUpdate && MLX5_WQE_CTRL_FENCE == kCtrlFence, "ctrl flags");
static_assert(MLX5_CQE_REQ == kCqeReq && MLX5_CQE_REQ_ERR == kCqeReqErr &&
              MLX5_CQE_RESP_ERR == kCqeRespErr && MLX5_CQE_INVALID == kCqeInvalid, "cqe opcodes");
static_assert(MLX5_CQE_SYNDROME_LOCAL_PROT_ERR == kSyndLocalProtErr &&
              MLX5_CQE_SYNDROME_WR_FLUSH_ERR == kSyndWrFlushErr &&
              MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR == kSyndRemoteAccessErr &&
              MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR == kSyndTransportRetryExcErr &&
              MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR == kSyndLocalLengthErr,
              "syndromes");
#pragma GCC diagnostic pop
}  // namespace rdma_core_check
}  // namespace prm
}  // namespace pyep
#endif
