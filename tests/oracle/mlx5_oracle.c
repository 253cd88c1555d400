/* An independent oracle for pyep's WQE/CQE bytes, built from rdma-core's own header.
 *
 * Compiled by tests/oracle/__init__.py at test time against the system's infiniband/mlx5dv.h and
 * loaded with ctypes. ctrl and data segments come from rdma-core's static-inline helpers; the
 * segments rdma-core has no helper for are filled through its structs (or, for the extended atomic,
 * from the PRM layout) with htobe*, never through pyep's code.
 */
#include <endian.h>
#include <stdint.h>
#include <string.h>

#include <infiniband/mlx5dv.h>

/* Extended ("masked") atomic segment for a 4-byte operand: add_data, field_boundary, then 8 unused
 * bytes. rdma-core v44 declares no struct for it, so it is spelled out from the PRM here. */
struct oracle_masked_fa32_seg {
	__be32 add_data;
	__be32 field_boundary;
	__be64 reserved;
};

void oracle_ctrl_seg(void *out, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qpn,
		     uint8_t fm_ce_se, uint8_t ds, uint8_t signature, uint32_t imm)
{
	struct mlx5_wqe_ctrl_seg seg;
	memset(&seg, 0, sizeof(seg));
	mlx5dv_set_ctrl_seg(&seg, pi, opcode, opmod, qpn, fm_ce_se, ds, signature, imm);
	memcpy(out, &seg, sizeof(seg));
}

void oracle_data_seg(void *out, uint32_t length, uint32_t lkey, uint64_t addr)
{
	struct mlx5_wqe_data_seg seg;
	memset(&seg, 0, sizeof(seg));
	mlx5dv_set_data_seg(&seg, length, lkey, (uintptr_t)addr);
	memcpy(out, &seg, sizeof(seg));
}

void oracle_raddr_seg(void *out, uint64_t raddr, uint32_t rkey)
{
	struct mlx5_wqe_raddr_seg seg;
	memset(&seg, 0, sizeof(seg));
	seg.raddr = htobe64(raddr);
	seg.rkey = htobe32(rkey);
	memcpy(out, &seg, sizeof(seg));
}

void oracle_atomic_seg(void *out, uint64_t swap_add, uint64_t compare)
{
	struct mlx5_wqe_atomic_seg seg;
	memset(&seg, 0, sizeof(seg));
	seg.swap_add = htobe64(swap_add);
	seg.compare = htobe64(compare);
	memcpy(out, &seg, sizeof(seg));
}

void oracle_masked_fa32_seg(void *out, uint32_t add, uint32_t field_boundary)
{
	struct oracle_masked_fa32_seg seg;
	memset(&seg, 0, sizeof(seg));
	seg.add_data = htobe32(add);
	seg.field_boundary = htobe32(field_boundary);
	memcpy(out, &seg, sizeof(seg));
}

/* A requester CQE through struct mlx5_cqe64. */
void oracle_cqe(void *out, uint8_t opcode, uint8_t owner, uint16_t wqe_counter, uint32_t qpn,
		uint8_t wqe_opcode, uint32_t byte_cnt)
{
	struct mlx5_cqe64 cqe;
	memset(&cqe, 0, sizeof(cqe));
	cqe.byte_cnt = htobe32(byte_cnt);
	cqe.sop_drop_qpn = htobe32(((uint32_t)wqe_opcode << 24) | (qpn & 0xffffff));
	cqe.wqe_counter = htobe16(wqe_counter);
	cqe.op_own = (uint8_t)(opcode << 4);
	mlx5dv_set_cqe_owner(&cqe, owner);
	memcpy(out, &cqe, sizeof(cqe));
}

/* An error CQE through struct mlx5_err_cqe. */
void oracle_err_cqe(void *out, uint8_t opcode, uint8_t owner, uint16_t wqe_counter, uint32_t qpn,
		    uint8_t wqe_opcode, uint8_t syndrome, uint8_t vendor_syndrome)
{
	struct mlx5_err_cqe cqe;
	memset(&cqe, 0, sizeof(cqe));
	cqe.syndrome = syndrome;
	cqe.vendor_err_synd = vendor_syndrome;
	cqe.s_wqe_opcode_qpn = htobe32(((uint32_t)wqe_opcode << 24) | (qpn & 0xffffff));
	cqe.wqe_counter = htobe16(wqe_counter);
	cqe.op_own = (uint8_t)((opcode << 4) | (owner & 1));
	memcpy(out, &cqe, sizeof(cqe));
}

/* rdma-core's own CQE accessors, to check pyep's decoder against. */
uint8_t oracle_cqe_opcode(const void *cqe64)
{
	struct mlx5_cqe64 cqe;
	memcpy(&cqe, cqe64, sizeof(cqe));
	return mlx5dv_get_cqe_opcode(&cqe);
}

uint8_t oracle_cqe_owner(const void *cqe64)
{
	struct mlx5_cqe64 cqe;
	memcpy(&cqe, cqe64, sizeof(cqe));
	return mlx5dv_get_cqe_owner(&cqe);
}

uint32_t oracle_constant(const char *name)
{
	/* rdma-core's values for the names pyep's prm.h mirrors; 0xffffffff = unknown name. */
	static const struct { const char *name; uint32_t value; } table[] = {
		{"SEND_WQE_BB", MLX5_SEND_WQE_BB},
		{"OPCODE_NOP", MLX5_OPCODE_NOP},
		{"OPCODE_RDMA_WRITE", MLX5_OPCODE_RDMA_WRITE},
		{"OPCODE_RDMA_WRITE_IMM", MLX5_OPCODE_RDMA_WRITE_IMM},
		{"OPCODE_SEND", MLX5_OPCODE_SEND},
		{"OPCODE_RDMA_READ", MLX5_OPCODE_RDMA_READ},
		{"OPCODE_ATOMIC_CS", MLX5_OPCODE_ATOMIC_CS},
		{"OPCODE_ATOMIC_FA", MLX5_OPCODE_ATOMIC_FA},
		{"OPCODE_ATOMIC_MASKED_CS", MLX5_OPCODE_ATOMIC_MASKED_CS},
		{"OPCODE_ATOMIC_MASKED_FA", MLX5_OPCODE_ATOMIC_MASKED_FA},
		{"CTRL_SOLICITED", MLX5_WQE_CTRL_SOLICITED},
		{"CTRL_CQ_UPDATE", MLX5_WQE_CTRL_CQ_UPDATE},
		{"CTRL_SMALL_FENCE", MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE},
		{"CTRL_FENCE", MLX5_WQE_CTRL_FENCE},
		{"CQE_REQ", MLX5_CQE_REQ},
		{"CQE_RESP_WR_IMM", MLX5_CQE_RESP_WR_IMM},
		{"CQE_RESP_SEND", MLX5_CQE_RESP_SEND},
		{"CQE_REQ_ERR", MLX5_CQE_REQ_ERR},
		{"CQE_RESP_ERR", MLX5_CQE_RESP_ERR},
		{"CQE_INVALID", MLX5_CQE_INVALID},
		{"SYNDROME_LOCAL_LENGTH_ERR", MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR},
		{"SYNDROME_LOCAL_QP_OP_ERR", MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR},
		{"SYNDROME_LOCAL_PROT_ERR", MLX5_CQE_SYNDROME_LOCAL_PROT_ERR},
		{"SYNDROME_WR_FLUSH_ERR", MLX5_CQE_SYNDROME_WR_FLUSH_ERR},
		{"SYNDROME_MW_BIND_ERR", MLX5_CQE_SYNDROME_MW_BIND_ERR},
		{"SYNDROME_BAD_RESP_ERR", MLX5_CQE_SYNDROME_BAD_RESP_ERR},
		{"SYNDROME_LOCAL_ACCESS_ERR", MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR},
		{"SYNDROME_REMOTE_INVAL_REQ_ERR", MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR},
		{"SYNDROME_REMOTE_ACCESS_ERR", MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR},
		{"SYNDROME_REMOTE_OP_ERR", MLX5_CQE_SYNDROME_REMOTE_OP_ERR},
		{"SYNDROME_TRANSPORT_RETRY_EXC_ERR", MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR},
		{"SYNDROME_RNR_RETRY_EXC_ERR", MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR},
		{"SYNDROME_REMOTE_ABORTED_ERR", MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR},
	};
	for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); ++i)
		if (strcmp(table[i].name, name) == 0)
			return table[i].value;
	return 0xffffffffu;
}
