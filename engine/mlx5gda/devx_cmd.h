// mlx5 PRM command mailboxes for DevX host setup: encoders for the commands pyep sends (CREATE_CQ,
// CREATE_QP, the QP state transitions, QUERY_QP, QUERY_HCA_CAP) and parsers for their outputs.
//
// A PRM mailbox is a big-endian bit string: a field is named by (bit offset, width), bit 0 being the
// most significant bit of byte 0, exactly as the mlx5_ifc layouts (rdma-core providers/mlx5/mlx5_ifc.h,
// Linux include/linux/mlx5/mlx5_ifc.h) describe it. The offsets below are the facts taken from those
// layouts; everything is built with set_field()/get_field() so that one tested routine does all the bit
// arithmetic. Nothing here touches a device: the DevX provider hands these bytes to
// mlx5dv_devx_obj_create/modify/query, and the CPU tests compare them bit for bit against offsets
// derived independently from the PRM tables.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

namespace pyep {
namespace devx {

using Bytes = std::vector<uint8_t>;

// --- bit-field access ---------------------------------------------------------------------------------
// Throw std::invalid_argument when the value does not fit the width or the field leaves the buffer.
void set_field(uint8_t* buf, size_t len, uint32_t bit_off, uint32_t width, uint64_t value);
uint64_t get_field(const uint8_t* buf, size_t len, uint32_t bit_off, uint32_t width);
// Byte-aligned arrays (GIDs, MACs): copied as they are, network order.
void set_bytes(uint8_t* buf, size_t len, uint32_t bit_off, const uint8_t* src, size_t n);

struct Field {
    uint32_t off;
    uint32_t width;
};

// --- command opcodes (MLX5_CMD_OP_*) -------------------------------------------------------------------
enum Opcode : uint16_t {
    kCmdQueryHcaCap = 0x100,
    kCmdCreateCq = 0x400,
    kCmdDestroyCq = 0x401,
    kCmdCreateQp = 0x500,
    kCmdDestroyQp = 0x501,
    kCmdRst2InitQp = 0x502,
    kCmdInit2RtrQp = 0x503,
    kCmdRtr2RtsQp = 0x504,
    kCmd2ErrQp = 0x507,
    kCmd2RstQp = 0x50a,
    kCmdQueryQp = 0x50b,
};

// Mailbox sizes in bytes (the `in`/`out` structs, without trailing PAS arrays).
constexpr size_t kCreateCqInBytes = 0x880 / 8;
constexpr size_t kCreateQpInBytes = 0x880 / 8;
constexpr size_t kModifyQpInBytes = 0x880 / 8;  // rst2init / init2rtr / rtr2rts
constexpr size_t kQpnOnlyInBytes = 0x80 / 8;    // 2err / 2rst / query_qp / destroy
constexpr size_t kQueryHcaCapInBytes = 0x80 / 8;
constexpr size_t kCmdOutHdrBytes = 0x80 / 8;    // status, syndrome, object id
constexpr size_t kQueryQpOutBytes = 0x880 / 8;
constexpr size_t kQueryHcaCapOutBytes = 0x10 + 0x1000;  // header + 4 KiB capability page

// QUERY_HCA_CAP op_mod = capability type << 1 | (1 = current values, 0 = maximum).
enum CapType : uint16_t { kCapTypeGeneral = 0x0, kCapTypeAtomic = 0x3, kCapTypeRoce = 0x4 };

// qpc enumerations.
enum : uint8_t {
    kQpcStRc = 0x0,
    kQpcPmMigrated = 0x3,
    kRqZeroLen = 0x3,  // rq_type: no receive queue at all (pyep only sends)
    kTsFreeRunning = 0x0,
    kTsDefault = 0x1,
};

// IB MTU enumeration used by qpc.mtu (same values as enum ibv_mtu).
uint8_t mtu_enum(uint32_t bytes);  // 256..4096, else std::invalid_argument
uint32_t mtu_bytes(uint8_t mtu_enum);

// atomic_operations bits (MLX5_ATOMIC_OPS_*) and atomic_size_qp bits (bit n: 2^n-byte operands).
enum : uint16_t {
    kAtomicOpCmpSwap = 1 << 0,
    kAtomicOpFetchAdd = 1 << 1,
    kAtomicOpMaskedCmpSwap = 1 << 2,
    kAtomicOpMaskedFetchAdd = 1 << 3,
    kAtomicSize4B = 1 << 2,
    kAtomicSize8B = 1 << 3,
};
// qpc.atomic_mode for a QP given the device's atomic_size_qp: 0 none, 2 ConnectX mode (up to 4 B),
// else log2 of the largest operand (3 = up to 8 B), which also admits the 4-byte extended atomics.
uint8_t atomic_mode_for(uint16_t atomic_size_qp);

// --- command parameters ----------------------------------------------------------------------------------
struct CreateCqParams {
    uint32_t log_cq_size = 0;     // 2^log CQEs
    uint32_t uar_page = 0;
    uint32_t eqn = 0;
    uint32_t cq_umem_id = 0;
    uint64_t cq_umem_offset = 0;
    uint32_t dbr_umem_id = 0;
    uint64_t dbr_offset = 0;      // doorbell record's offset inside its UMEM (8-byte aligned)
    uint32_t log_page_size = 0;   // UMEM page shift - 12
    bool collapsed = false;       // cc: every CQE goes to entry 0
    bool overrun_ignore = false;  // oi
};

struct CreateQpParams {
    uint32_t pd = 0;
    uint32_t uar_page = 0;
    uint32_t cqn_snd = 0;
    uint32_t cqn_rcv = 0;
    uint32_t log_sq_size = 0;     // 2^log WQEBBs
    uint32_t log_msg_max = 0;
    uint32_t wq_umem_id = 0;
    uint64_t wq_umem_offset = 0;
    uint32_t dbr_umem_id = 0;
    uint64_t dbr_offset = 0;
    uint32_t log_page_size = 0;
    uint32_t ts_format = kTsFreeRunning;
    uint32_t user_index = 0;
};

struct Rst2InitParams {
    uint32_t qpn = 0;
    uint32_t port = 1;            // vhca_port_num
    uint32_t pkey_index = 0;
    bool remote_read = false;     // rre
    bool remote_write = false;    // rwe
    bool remote_atomic = false;   // rae
    uint32_t atomic_mode = 0;
};

struct Init2RtrParams {
    uint32_t qpn = 0;
    uint32_t mtu = 4096;          // bytes
    uint32_t log_msg_max = 30;
    uint32_t remote_qpn = 0;
    uint32_t next_rcv_psn = 0;
    uint32_t min_rnr_nak = 12;
    uint32_t log_rra_max = 4;     // responder resources for remote reads/atomics, log2
    uint32_t port = 1;
    bool roce = false;            // Ethernet link layer: GRH always, MAC, UDP source port
    // InfiniBand
    uint32_t rlid = 0;
    uint32_t sl = 0;              // IB: SL (4 bits); RoCE: Ethernet priority (3 bits)
    bool grh = false;             // IB: use the GID fields below (global routing)
    // GRH / RoCE
    uint8_t rgid[16] = {};
    uint8_t rmac[6] = {};
    uint32_t src_addr_index = 0;  // local GID index
    uint32_t hop_limit = 64;
    uint32_t traffic_class = 0;
    uint32_t flow_label = 0;
    uint32_t udp_sport = 0;       // RoCE v2 source port; 0 = let the device pick
};

struct Rtr2RtsParams {
    uint32_t qpn = 0;
    uint32_t retry_count = 7;
    uint32_t rnr_retry = 7;
    uint32_t ack_timeout = 20;    // 4.096 us * 2^ack_timeout
    uint32_t next_send_psn = 0;
    uint32_t log_sra_max = 4;     // outstanding reads/atomics as requester, log2
    uint32_t log_ack_req_freq = 0;
};

// --- encoders ------------------------------------------------------------------------------------------
Bytes encode_create_cq(const CreateCqParams& p);
Bytes encode_create_qp(const CreateQpParams& p);
Bytes encode_rst2init(const Rst2InitParams& p);
Bytes encode_init2rtr(const Init2RtrParams& p);
Bytes encode_rtr2rts(const Rtr2RtsParams& p);
Bytes encode_qp_2err(uint32_t qpn);
Bytes encode_qp_2rst(uint32_t qpn);
Bytes encode_query_qp(uint32_t qpn);
Bytes encode_query_hca_cap(uint16_t cap_type, bool current);

// --- output parsing ------------------------------------------------------------------------------------
struct CmdStatus {
    uint8_t status = 0;
    uint32_t syndrome = 0;
};
CmdStatus parse_status(const uint8_t* out, size_t len);
std::string status_name(uint8_t status);          // "BAD_PARAM", ... for error messages
uint32_t parse_created_id(const uint8_t* out, size_t len);  // cqn / qpn of CREATE_CQ / CREATE_QP
uint8_t parse_query_qp_state(const uint8_t* out, size_t len);

struct HcaCaps {
    // general device capabilities (cmd_hca_cap)
    uint32_t log_max_qp_sz = 0;
    uint32_t log_max_qp = 0;
    uint32_t log_max_cq_sz = 0;
    uint32_t log_max_cq = 0;
    uint32_t log_max_msg = 0;
    uint32_t log_max_pd = 0;
    uint32_t cqe_version = 0;
    uint32_t port_type = 0;       // 0 IB, 1 Ethernet
    uint32_t num_ports = 0;
    uint32_t log_bf_reg_size = 0;
    uint32_t log_max_ra_req_qp = 0;
    uint32_t log_max_ra_res_qp = 0;
    uint32_t sq_ts_format = 0;
    bool atomic = false;
    bool roce = false;
    bool rc = false;
    bool uar_4k = false;
    bool umem_uid_0 = false;
    // atomic capabilities
    uint32_t atomic_operations = 0;
    uint32_t atomic_size_qp = 0;
    uint32_t atomic_req_8b_endianness_mode = 0;
    // derived
    bool fetch_add_64 = false;         // ATOMIC_FA, 8 bytes
    bool masked_fetch_add_32 = false;  // ATOMIC_MASKED_FA with a 4-byte operand
};
// `general` and `atomic` are full QUERY_HCA_CAP outputs (header + capability page); the atomic one may
// be empty when the device has no atomic support (general.atomic == 0).
HcaCaps parse_hca_caps(const uint8_t* general, size_t general_len, const uint8_t* atomic, size_t atomic_len);

}  // namespace devx
}  // namespace pyep
