// pyep._engine part "normal_fast": the host work of a cached normal-mode dispatch and of a combine in one
// binding call (docs/normal_mode.md, "Host path"): check x (and the weights), launch the call gate, take
// the outputs (one-copy: the output pool's region; else the CUDA caching allocator), launch the kernel on
// the current stream. Everything else a call needs was fixed by the Python path's first call with that
// handle and config and kept in a NormalPlan on the handle. CUDA builds only.
//
// A call the fast path does not take returns None before anything is launched or allocated, and the
// Python path (NormalBuffer, NormalNativeBackend) runs it instead: any argument that is not a plain dense
// tensor of the plan's shape, dtype and device, rows 16-byte aligned (the Python path raises the typed
// error and refuses the call to the peers), an error or void call the device recorded (the Python path
// raises it), a buffer not `ready` (broken, a mask, a grace window, destroyed: NormalNativeBackend keeps
// the flag), a handle of an earlier generation or of another buffer, a ring geometry other than the last
// call's, a stream being captured, deterministic allocation.
#if defined(PYEP_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>

#include "bindings/fast_tensor.h"
#include "bindings/registry.h"
#include "kernels/normal_launch.h"
#include "kernels/normal_tags.h"

namespace py = pybind11;
using namespace pyep::normal;
using pyep::bindings::empty_2d;

namespace {

// What a cached dispatch or a combine with one handle and config passes to its gate and kernel.
struct NormalPlan {
    uint64_t owner = 0;          // NormalFast::id of the buffer that made it
    int epoch = 0;               // the handle's generation (NormalBuffer clean() starts a new one)
    int64_t num_tokens = 0;      // N of the handle's dispatch
    int64_t hidden = 0;          // H of the call that made the plan (the gate's first signature word)
    int64_t rows = 0;            // the handle's received rows (num_recv_rows)
    int num_worst_tokens = 0;
    int channels = 0, ring = 0, chunk = 0;
    int64_t slot = 0;            // layout.slot_bytes(hidden): with ring, the geometry of the rings
    uint64_t in_rank = 0, rpm = 0, cpm = 0, rcp = 0, send_head = 0, tag = 0;
};

// A plain dense tensor (exactly torch.Tensor, strided, with storage) on CUDA device `dev`, or null.
const at::Tensor* tensor_on(PyObject* o, int dev) {
    if (!THPVariable_CheckExact(o)) return nullptr;
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != c10::kStrided || !t.unsafeGetTensorImpl()->has_storage() || !t.is_cuda() ||
        t.get_device() != dev)
        return nullptr;
    return &t;
}

bool is_2d(const at::Tensor& t, c10::ScalarType dtype, int64_t rows, int64_t cols) {
    return t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
}

uint64_t addr(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// Rows the kernels move with 16-byte vector accesses: a contiguous view may still start at an odd element
// (validate.check_aligned, which the Python path raises).
bool rows_aligned(const at::Tensor& t) { return addr(t) % 16 == 0; }

int32_t read_pinned(uint64_t p, int i) { return reinterpret_cast<const volatile int32_t*>(p)[i]; }

// The handle's and the config's fields, which DispatchArgs and CombineArgs share.
template <typename Args>
void from_plan(Args& a, const NormalPlan& p) {
    a.rank_prefix_matrix = p.rpm;
    a.channel_prefix_matrix = p.cpm;
    a.recv_channel_prefix_matrix = p.rcp;
    a.num_tokens = static_cast<int>(p.num_tokens);
    a.hidden = static_cast<int>(p.hidden);
    a.num_channels = p.channels;
    a.ring_tokens = p.ring;
    a.chunk_tokens = p.chunk;
}

std::atomic<uint64_t> next_fast_id{1};

struct NormalFast {
    const uint64_t id = next_fast_id.fetch_add(1);   // never reused, unlike an address
    py::object static_obj;       // the backend's NormalStatic (it changes slot_bytes / timeout_ns in place)
    NormalStatic* s = nullptr;
    int device = 0;
    uint64_t timeout_ns = 0;     // the buffer's kernel timeout (the Python path widens it in a grace window)
    int tma_dispatch = 0, tma_combine = 0;
    bool pull = false;           // pull combine offers (native.py pull_offer; set with `ready`)
    py::object pool;             // OutputPool.fast_outputs, or None: no output pool (no one-copy handshake)
    // Kept by NormalNativeBackend.
    bool ready = false;
    int epoch = 0;
    int voids_seen = 0;
    int geo_ring = -1;
    int64_t geo_slot = -1;
    uint64_t calls = 0;          // calls taken (tests)

    NormalFast(py::object st, int dev, uint64_t timeout_us, int tma_d, int tma_c, py::object pool_outputs)
        : static_obj(std::move(st)), device(dev), timeout_ns(timeout_us * 1000ull), tma_dispatch(tma_d),
          tma_combine(tma_c), pool(std::move(pool_outputs)) {
        s = static_obj.cast<NormalStatic*>();
    }

    bool declines(const NormalPlan& p) const {
        if (!ready || p.owner != id || p.epoch != epoch) return true;
        if (p.ring != geo_ring || p.slot != geo_slot) return true;
        // A recorded error or a void call: the Python path takes and raises it.
        if (read_pinned(s->err, 0) != 0 || read_pinned(s->tag_record, kRecVoids) != voids_seen) return true;
        return pyep::bindings::empty_fills_memory();
    }

    // The current stream of the buffer's device (the legacy default stream is 0); false while it is being
    // captured into a CUDA graph.
    bool current_stream(cudaStream_t* st) const {
        *st = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        return cudaStreamIsCapturing(*st, &cap) == cudaSuccess && cap == cudaStreamCaptureStatusNone;
    }

    void gate(int kind, int64_t w0, int64_t w1, int64_t w2, int64_t w3, uint64_t handle_tag, cudaStream_t st,
              int pull_offer = 0, int64_t pull_rows = 0, uint64_t pull_x = 0) {
        NotifyArgs a;
        a.pull_offer = pull_offer;
        a.pull_rows = static_cast<int>(pull_rows);
        a.pull_x = pull_x;
        a.gate_only = 1;
        a.kind = kind;
        a.status = kTagOk;
        a.sig[0] = static_cast<int>(w0);
        a.sig[1] = static_cast<int>(w1);
        a.sig[2] = static_cast<int>(w2);
        a.sig[3] = static_cast<int>(w3);
        a.handle_tag = handle_tag;
        s->timeout_ns = timeout_ns;
        launch_notify(*s, a, reinterpret_cast<uint64_t>(st));
    }

    // x: bf16 [N, H], or (e4m3 [N, H], fp32 scales [N, H/128] of any strides) -> recv_x, or
    // (recv_x, recv_x_scales); None: not taken.
    py::object dispatch(const NormalPlan& p, py::handle x_h) {
        if (declines(p)) return py::none();
        PyObject* xo = x_h.ptr();
        PyObject* so = nullptr;
        if (PyTuple_Check(xo)) {
            if (PyTuple_GET_SIZE(xo) != 2) return py::none();
            so = PyTuple_GET_ITEM(xo, 1);
            xo = PyTuple_GET_ITEM(xo, 0);
        }
        const bool fp8 = so != nullptr;
        const int64_t n = p.num_tokens, h = p.hidden, groups = h / 128;
        const at::Tensor* x = tensor_on(xo, device);
        if (!x || !is_2d(*x, fp8 ? c10::ScalarType::Float8_e4m3fn : c10::ScalarType::BFloat16, n, h) ||
            !x->is_contiguous() || !rows_aligned(*x))
            return py::none();
        const at::Tensor* sc = fp8 ? tensor_on(so, device) : nullptr;
        if (fp8 && (!sc || !is_2d(*sc, c10::ScalarType::Float, n, groups))) return py::none();
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        cudaStream_t st = nullptr;
        if (!current_stream(&st)) return py::none();

        // Taken: from here on the call is made, as the Python path makes it.
        const bool direct = !pool.is_none();
        gate(kKindCached, h, p.channels, p.ring, int(fp8) | int(direct) << 1, p.tag, st);
        py::object recv_x, recv_scales = py::none();
        uint64_t stage = 0;
        bool offer = false;
        if (direct) {
            py::object outs = pool(p.rows, h, fp8, reinterpret_cast<uint64_t>(st));
            if (!outs.is_none()) {
                py::tuple t = outs.cast<py::tuple>();
                recv_x = t[0];
                recv_scales = t[1];
                stage = t[2].cast<uint64_t>();
                offer = true;
            }
        }
        if (!offer) {
            recv_x = py::cast(empty_2d(x->dtype(), p.rows, h));
            if (fp8) recv_scales = py::cast(empty_2d(caffe2::TypeMeta::Make<float>(), p.rows, groups));
        }
        DispatchArgs a;
        a.direct = direct;
        a.direct_offer = offer;
        a.direct_stage = stage;
        a.x = addr(*x);
        if (fp8) {
            a.x_scales = addr(*sc);
            a.scale_token_stride = sc->stride(0);   // read in place, any layout
            a.scale_group_stride = sc->stride(1);
        }
        from_plan(a, p);
        a.is_token_in_rank = p.in_rank;
        a.fp8 = fp8;
        a.num_out_rows = static_cast<int>(p.rows);
        a.num_worst_tokens = p.num_worst_tokens;
        a.use_tma = tma_dispatch;
        a.recv_x = addr(THPVariable_Unpack(recv_x.ptr()));
        if (fp8) a.recv_x_scales = addr(THPVariable_Unpack(recv_scales.ptr()));
        launch_dispatch(*s, a, reinterpret_cast<uint64_t>(st));
        ++calls;
        return fp8 ? py::object(py::make_tuple(recv_x, recv_scales)) : recv_x;
    }

    // x: bf16 [rows, H]; weights: None or fp32 [rows, K] -> (combined_x, combined_weights | None); None:
    // not taken. No bias (the Python path takes calls with one).
    py::object combine(const NormalPlan& p, py::handle x_h, py::handle w_h) {
        if (declines(p)) return py::none();
        const int64_t n = p.num_tokens, h = p.hidden, rows = p.rows;
        const at::Tensor* x = tensor_on(x_h.ptr(), device);
        if (!x || !is_2d(*x, c10::ScalarType::BFloat16, rows, h) || !x->is_contiguous() || !rows_aligned(*x))
            return py::none();
        const at::Tensor* w = nullptr;
        int64_t k = 0;
        if (!w_h.is_none()) {
            w = tensor_on(w_h.ptr(), device);
            if (!w || w->dim() != 2) return py::none();
            k = w->size(1);
            if (k < 1 || k > kMaxTopk || !is_2d(*w, c10::ScalarType::Float, rows, k) || !w->is_contiguous())
                return py::none();
        }
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        cudaStream_t st = nullptr;
        if (!current_stream(&st)) return py::none();

        // The pull offer (native.py pull_offer): x inside the output pool, no weights (ready: no mask).
        int offer = 0;
        uint64_t x_off = 0;
        if (pull && !k && s->pool_hi) {
            const uint64_t xa = addr(*x), lo = s->buf + s->pool_lo, hi = s->buf + s->pool_hi;
            if (rows == 0) offer = 1, x_off = s->pool_lo;
            else if (xa >= lo && xa <= hi && static_cast<uint64_t>(rows * h * 2) <= hi - xa) offer = 1, x_off = xa - s->buf;
        }
        gate(kKindCombine, h, p.channels, p.ring, k, p.tag, st, offer, offer ? rows : 0, x_off);
        at::Tensor out = empty_2d(caffe2::TypeMeta::Make<c10::BFloat16>(), n, h);
        at::Tensor out_w;
        if (k) out_w = empty_2d(caffe2::TypeMeta::Make<float>(), n, k);
        CombineArgs a;
        a.use_tma = tma_combine;
        a.x = addr(*x);
        a.topk_weights = w ? addr(*w) : 0;
        a.send_head = p.send_head;
        from_plan(a, p);
        a.num_topk = static_cast<int>(k);
        a.out = addr(out);
        a.out_weights = k ? addr(out_w) : 0;
        a.pull = offer;
        launch_combine(*s, a, reinterpret_cast<uint64_t>(st));
        ++calls;
        return py::make_tuple(out, k ? py::cast(out_w) : py::none());
    }
};

void register_normal_fast(py::module_& m) {
    auto n = m.attr("normal").cast<py::module_>();
    py::class_<NormalPlan>(n, "NormalPlan", "A handle's cached dispatch or combine, as the fast path launches it")
        .def(py::init<>())
        .def_readwrite("owner", &NormalPlan::owner)
        .def_readwrite("epoch", &NormalPlan::epoch)
        .def_readwrite("num_tokens", &NormalPlan::num_tokens)
        .def_readwrite("hidden", &NormalPlan::hidden)
        .def_readwrite("rows", &NormalPlan::rows)
        .def_readwrite("num_worst_tokens", &NormalPlan::num_worst_tokens)
        .def_readwrite("channels", &NormalPlan::channels)
        .def_readwrite("ring", &NormalPlan::ring)
        .def_readwrite("chunk", &NormalPlan::chunk)
        .def_readwrite("slot", &NormalPlan::slot)
        .def_readwrite("in_rank", &NormalPlan::in_rank)
        .def_readwrite("rpm", &NormalPlan::rpm)
        .def_readwrite("cpm", &NormalPlan::cpm)
        .def_readwrite("rcp", &NormalPlan::rcp)
        .def_readwrite("send_head", &NormalPlan::send_head)
        .def_readwrite("tag", &NormalPlan::tag);
    py::class_<NormalFast>(n, "NormalFast", "Cached dispatch and combine in one binding call (None: not taken)")
        .def(py::init<py::object, int, uint64_t, int, int, py::object>(), py::arg("static"), py::arg("device"),
             py::arg("timeout_us"), py::arg("tma_dispatch"), py::arg("tma_combine"), py::arg("pool_outputs"))
        .def_readonly("id", &NormalFast::id)
        .def_readwrite("pool", &NormalFast::pool)
        .def_readwrite("ready", &NormalFast::ready)
        .def_readwrite("pull", &NormalFast::pull)
        .def_readwrite("epoch", &NormalFast::epoch)
        .def_readwrite("voids_seen", &NormalFast::voids_seen)
        .def_readwrite("geo_ring", &NormalFast::geo_ring)
        .def_readwrite("geo_slot", &NormalFast::geo_slot)
        .def_readonly("calls", &NormalFast::calls)
        .def("dispatch", &NormalFast::dispatch, py::arg("plan"), py::arg("x"))
        .def("combine", &NormalFast::combine, py::arg("plan"), py::arg("x"), py::arg("topk_weights"));
}

// module.cpp registers the parts in name order: "normal" (NormalStatic, the submodule) comes first.
pyep::bindings::Registrar reg("normal_fast", &register_normal_fast);

}  // namespace
#endif  // PYEP_WITH_CUDA
