"""Step-by-step smoke run of the softnic's CUDA backend (prints each step; for debugging on a GPU box)."""
import sys

import torch

from pyep.softnic import ConnectAttr, Placement, SoftNic, SoftNicConfig, new_fabric_id


def step(msg):
    print("STEP", msg, flush=True)


fabric = new_fabric_id()
step("softnic a")
a = SoftNic(SoftNicConfig(node_id=0, fabric_id=fabric, cuda_device=0))
step("softnic b")
b = SoftNic(SoftNicConfig(node_id=1, fabric_id=fabric, cuda_device=0))
step("cq")
cq_a, cq_b = a.create_cq(6, Placement.HOST_MAPPED), b.create_cq(6, Placement.HOST_MAPPED)
step("qp")
qp_a, qp_b = a.create_qp(cq_a, 4, Placement.HOST_MAPPED), b.create_qp(cq_b, 4, Placement.HOST_MAPPED)
step("connect")
a.connect(qp_a, 1, qp_b.qpn, ConnectAttr(ack_timeout=14))
b.connect(qp_b, 0, qp_a.qpn, ConnectAttr(ack_timeout=14))
step("host_qp")
poster = a.host_qp(qp_a, cq_a)
n = 1 << 16
src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
sig = torch.zeros(8, dtype=torch.int64, device="cuda")
fetch = torch.zeros(8, dtype=torch.int64, device="cuda")
torch.cuda.synchronize()
step("reg_mr")
ms, md, mg, mf = a.reg_mr(src), b.reg_mr(dst), b.reg_mr(sig), a.reg_mr(fetch)
step("post write")
st = poster.post_rdma_write(src.data_ptr(), ms.lkey, dst.data_ptr(), md.rkey, 4096, True)
step(f"post -> {st}")
step(f"quiet -> {poster.quiet(timeout_s=10)}")
print("equal", torch.equal(dst[:4096], src[:4096]), flush=True)
st = poster.post_write_with_signal(src.data_ptr(), ms.lkey, dst.data_ptr(), md.rkey, 4096,
                                   sig.data_ptr(), mg.rkey, 1, fetch.data_ptr(), mf.lkey)
step(f"post ws -> {st} quiet -> {poster.quiet(timeout_s=10)}")
print("sig", int(sig.view(torch.int32)[0]), flush=True)
a.close()
b.close()
step("done")
