// pyep._engine part "ep": the low-latency EP kernels and the CUDA runtime helpers of the NVLink
// transport. CUDA builds only (this file is empty in the host-only build). Pointers and CUDA streams
// cross as Python ints (tensor.data_ptr(), torch.cuda.current_stream().cuda_stream), so launches stay
// CUDA-graph capturable and no torch header is needed.
#if defined(PYEP_WITH_CUDA)
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/registry.h"
#include "kernels/ll_launch.h"

namespace py = pybind11;
using namespace pyep::ll;

namespace {

void register_ep(py::module_& m) {
    auto ep = m.def_submodule("ep", "Low-latency MoE dispatch/combine kernels (pyep.ep.ll.native drives them)");

    py::class_<LLStatic>(ep, "LLStatic")
        .def(py::init<>())
        .def_readwrite("rank", &LLStatic::rank)
        .def_readwrite("num_ranks", &LLStatic::num_ranks)
        .def_readwrite("num_local_experts", &LLStatic::num_local_experts)
        .def_readwrite("num_max_tokens", &LLStatic::num_max_tokens)
        .def_readwrite("hidden", &LLStatic::hidden)
        .def_readwrite("max_topk", &LLStatic::max_topk)
        .def_readwrite("buf", &LLStatic::buf)
        .def_readwrite("peer_base", &LLStatic::peer_base)
        .def_readwrite("remote_addr", &LLStatic::remote_addr)
        .def_readwrite("rkeys", &LLStatic::rkeys)
        .def_readwrite("lkey", &LLStatic::lkey)
        .def_readwrite("qps", &LLStatic::qps)
        .def_readwrite("num_qps_per_peer", &LLStatic::num_qps_per_peer)
        .def_readwrite("flag_expect", &LLStatic::flag_expect)
        .def_readwrite("fetch_addr", &LLStatic::fetch_addr)
        .def_readwrite("workspace", &LLStatic::workspace)
        .def_readwrite("half_bytes", &LLStatic::half_bytes)
        .def_readwrite("off_dsig", &LLStatic::off_dsig)
        .def_readwrite("off_csig", &LLStatic::off_csig)
        .def_readwrite("off_cack", &LLStatic::off_cack)
        .def_readwrite("off_drecv", &LLStatic::off_drecv)
        .def_readwrite("off_crecv", &LLStatic::off_crecv)
        .def_readwrite("msg_bytes", &LLStatic::msg_bytes)
        .def_readwrite("slots_per_src", &LLStatic::slots_per_src)
        .def_readwrite("num_blocks", &LLStatic::num_blocks)
        .def_readwrite("trace", &LLStatic::trace)
        .def_readwrite("err", &LLStatic::err)
        .def_readwrite("call_err", &LLStatic::call_err)
        .def_readwrite("peer_gen", &LLStatic::peer_gen);
    ep.attr("TRACE_SLOTS") = kTraceSlots;
    ep.attr("ERR_WORDS") = kErrWords;
    ep.attr("CALL_ERR_WORDS") = kCallErrWords;
    ep.attr("MAX_TOKENS_PER_RANK") = kMaxTokensPerRank;

    ep.def(
        "dispatch",
        [](const LLStatic& s, uint64_t x, uint64_t topk, int num_tokens, int num_topk, int half, bool use_fp8,
           bool round_scale, bool use_ue8m0, uint64_t active, uint64_t recv_x, uint64_t recv_scales,
           uint64_t src_info, uint64_t recv_slot, uint64_t layout_range, uint64_t recv_count, uint64_t cum_stats,
           uint64_t timeout_ns, int phases, uint64_t stream, uint64_t wait_stats, uint32_t seq, int abort) {
            LLDispatchCall c;
            c.x = x;
            c.topk = topk;
            c.num_tokens = num_tokens;
            c.num_topk = num_topk;
            c.half = half;
            c.use_fp8 = use_fp8;
            c.round_scale = round_scale;
            c.use_ue8m0 = use_ue8m0;
            c.active = active;
            c.recv_x = recv_x;
            c.recv_scales = recv_scales;
            c.src_info = src_info;
            c.recv_slot = recv_slot;
            c.layout_range = layout_range;
            c.recv_count = recv_count;
            c.cum_stats = cum_stats;
            c.timeout_ns = timeout_ns;
            c.phases = phases;
            c.wait_stats = wait_stats;
            c.seq = seq;
            c.abort = abort;
            launch_dispatch(s, c, stream);
        },
        py::arg("static"), py::arg("x"), py::arg("topk"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("half"),
        py::arg("use_fp8"), py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("active"), py::arg("recv_x"),
        py::arg("recv_scales"), py::arg("src_info"), py::arg("recv_slot"), py::arg("layout_range"),
        py::arg("recv_count"), py::arg("cum_stats"), py::arg("timeout_ns"), py::arg("phases"), py::arg("stream"),
        py::arg("wait_stats") = 0, py::arg("seq") = 0, py::arg("abort") = 0,
        "Launch the dispatch kernel (phases: 1 send, 2 receive, 3 both; wait_stats: int64 [R] the receive adds "
        "each source's wait to, in ns, or 0; seq: the call number its signals are tagged with; abort: 0, or the "
        "reason this rank refused the call -- abort-tagged count words, no payload, no outputs).");

    ep.def(
        "combine",
        [](const LLStatic& s, uint64_t x, uint64_t topk, uint64_t weights, int num_tokens, int num_topk, int half,
           uint64_t src_info, uint64_t recv_slot, uint64_t layout_range, uint64_t active, uint64_t out,
           uint64_t timeout_ns, int phases, uint64_t stream, bool use_logfmt, uint64_t wait_stats, bool repeat,
           uint32_t seq, int abort) {
            LLCombineCall c;
            c.x = x;
            c.topk = topk;
            c.weights = weights;
            c.num_tokens = num_tokens;
            c.num_topk = num_topk;
            c.half = half;
            c.src_info = src_info;
            c.recv_slot = recv_slot;
            c.layout_range = layout_range;
            c.active = active;
            c.out = out;
            c.timeout_ns = timeout_ns;
            c.phases = phases;
            c.use_logfmt = use_logfmt ? 1 : 0;
            c.wait_stats = wait_stats;
            c.repeat = repeat ? 1 : 0;
            c.seq = seq;
            c.abort = abort;
            launch_combine(s, c, stream);
        },
        py::arg("static"), py::arg("x"), py::arg("topk"), py::arg("weights"), py::arg("num_tokens"),
        py::arg("num_topk"), py::arg("half"), py::arg("src_info"), py::arg("recv_slot"), py::arg("layout_range"),
        py::arg("active"), py::arg("out"), py::arg("timeout_ns"), py::arg("phases"), py::arg("stream"),
        py::arg("use_logfmt") = false, py::arg("wait_stats") = 0, py::arg("repeat") = false, py::arg("seq") = 0,
        py::arg("abort") = 0,
        "Launch the combine kernel (phases: 1 send, 2 receive, 3 both; use_logfmt: LogFMT-10 payload; "
        "wait_stats as for dispatch; repeat: the handle was combined before, so every destination's "
        "acknowledgement of our earlier combines on this half is awaited first; seq: its dispatch's call number; "
        "abort: as for dispatch -- abort-tagged flags, no rows, no reduce).");

    ep.def("dispatch_smem_bytes", &dispatch_smem_bytes, py::arg("static"));
    ep.def("combine_smem_bytes", &combine_smem_bytes, py::arg("static"));
    ep.def(
        "load_kernels",
        [](const LLStatic& s) {
            load_dispatch_kernels(s);
            load_combine_kernels(s);
        },
        py::arg("static"),
        "Load the dispatch and combine modules now and set their shared-memory limit for this shape "
        "(num_ranks, num_local_experts): no first call waits for a module load (ll_launch.h).");
    ep.attr("threads_per_block") = kThreadsPerBlock;

    ep.def("device_alloc", &device_alloc, py::arg("bytes"));
    ep.def("device_free", &device_free, py::arg("ptr"));
    ep.def("host_alloc_mapped", &host_alloc_mapped, py::arg("bytes"),
           "Zeroed pinned host memory the device reaches at the same address (the error record).");
    ep.def("host_free", &host_free, py::arg("ptr"));
    ep.def("memset_async", &memset_async, py::arg("ptr"), py::arg("value"), py::arg("bytes"), py::arg("stream"));
    ep.def("event_create", &event_create, "A CUDA event (timing off), as a handle.");
    ep.def("event_destroy", &event_destroy, py::arg("event"));
    ep.def("event_record", &event_record, py::arg("event"), py::arg("stream"));
    ep.def("stream_wait_event", &stream_wait_event, py::arg("stream"), py::arg("event"));
    ep.def(
        "memcpy_htod", [](uint64_t dst, py::bytes data) {
            const std::string s = data;
            memcpy_htod(dst, s.data(), s.size());
        },
        py::arg("dst"), py::arg("data"));
    ep.def(
        "ipc_get_handle", [](uint64_t ptr) { return py::bytes(ipc_get_handle(ptr)); }, py::arg("ptr"));
    ep.def(
        "ipc_open_handle", [](py::bytes h) { return ipc_open_handle(std::string(h)); }, py::arg("handle"));
    ep.def("ipc_close_handle", &ipc_close_handle, py::arg("ptr"));
    ep.def("device_pci_bus_id", &device_pci_bus_id, py::arg("device"));
    ep.def("can_access_peer", &can_access_peer, py::arg("device"), py::arg("peer_device"));
    ep.def("current_device", &current_device);
    ep.def("num_sms", &num_sms, py::arg("device"));
    ep.def("max_smem_optin", &max_smem_optin, py::arg("device"));
}

pyep::bindings::Registrar reg("ep", &register_ep);

}  // namespace
#endif  // PYEP_WITH_CUDA
