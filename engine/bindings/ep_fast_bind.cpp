// pyep._engine part "ep_fast": the per-call host work of a low-latency dispatch / combine in one binding
// call, the way DeepEP's runtime does it: check the arguments (ll_argcheck.h, the mirror of
// pyep/ep/validate.py), allocate the outputs through torch's CUDA caching allocator, fill the launch
// arguments and launch on the current stream. CUDA builds only (the extension is then a torch
// CUDAExtension, so torch headers are available here; engine/kernels/ stays torch-free).
//
// A call the fast path does not take returns None and the Python path (EpBuffer + NativeBackend) runs
// it instead: arguments validate.py rejects (it raises the typed error and sends the abort marker), for a
// combine a record the device wrote (EpBuffer decides whether that combine is skipped), async_finish /
// recv hook / strict checks / a running profiler (decided in Python before the call), an outstanding
// async_finish event (`blocked`). Nothing is changed before the decision, so declining is always safe.
#if defined(PYEP_WITH_CUDA)
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>

#include "bindings/fast_tensor.h"
#include "bindings/ll_argcheck.h"
#include "bindings/registry.h"
#include "kernels/ll_launch.h"

namespace py = pybind11;
namespace lc = pyep::llcheck;
using pyep::ll::LLCombineCall;
using pyep::ll::LLDispatchCall;
using pyep::ll::LLStatic;
using pyep::bindings::new_storage;
using pyep::bindings::over;

static_assert(static_cast<int>(c10::ScalarType::Int) == lc::kInt32, "ll_argcheck.h dtype codes");
static_assert(static_cast<int>(c10::ScalarType::Long) == lc::kInt64, "ll_argcheck.h dtype codes");
static_assert(static_cast<int>(c10::ScalarType::Float) == lc::kFloat32, "ll_argcheck.h dtype codes");
static_assert(static_cast<int>(c10::ScalarType::BFloat16) == lc::kBFloat16, "ll_argcheck.h dtype codes");
static_assert(static_cast<int>(c10::DeviceType::CPU) == lc::kDevCPU, "ll_argcheck.h device codes");
static_assert(static_cast<int>(c10::DeviceType::CUDA) == lc::kDevCUDA, "ll_argcheck.h device codes");

namespace {

// Metadata of one argument; anything unusual (not a strided tensor, no storage, symbolic sizes) is
// left as "not a tensor", which declines the call.
lc::TensorArg meta_of(PyObject* o) {
    lc::TensorArg m;
    if (o == Py_None) return m;
    m.present = true;
    if (!THPVariable_Check(o)) return m;
    try {
        const at::Tensor& t = THPVariable_Unpack(o);
        if (!t.defined() || t.layout() != c10::kStrided || !t.unsafeGetTensorImpl()->has_storage()) return m;
        const int64_t dim = t.dim();
        if (dim > lc::kMaxDims) return m;
        const auto sizes = t.sizes();
        for (int64_t i = 0; i < dim; ++i) m.sizes[i] = sizes[i];
        m.dim = static_cast<int>(dim);
        m.dtype = static_cast<int>(t.scalar_type());
        m.contiguous = t.is_contiguous();
        const c10::Device d = t.device();
        m.dev_type = static_cast<int>(d.type());
        m.dev_index = d.has_index() ? d.index() : -1;
        m.ptr = reinterpret_cast<uint64_t>(t.data_ptr());
        m.is_tensor = true;
    } catch (const c10::Error&) {
        m.is_tensor = false;
    }
    return m;
}

int flag_of(PyObject* o) { return o == Py_True ? 1 : (o == Py_False ? 0 : -1); }

lc::Timeout timeout_of(PyObject* o) {
    if (o == Py_None) return {0, 0};
    if (PyBool_Check(o) || !PyLong_Check(o)) return {2, 0};
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {   // beyond int64: declined (ll_argcheck.h timeout_ok)
        PyErr_Clear();
        return {2, 0};
    }
    return {1, v};
}

struct FastLL {
    LLStatic s;
    lc::Shape shape;
    int64_t default_timeout_us = 0;
    at::Tensor active;       // the backend's own mask (used when a call passes none)
    int half = 0;            // buffer half of the next dispatch (NativeBackend shares it)
    bool blocked = false;    // an async_finish event is outstanding: the Python path orders the streams
    uint64_t calls = 0;      // calls taken (diagnostics, tests)

    FastLL(const LLStatic& st, int device, int64_t T, int64_t H, int64_t E, int64_t R, int64_t max_topk,
           int64_t timeout_us, at::Tensor act)
        : s(st), default_timeout_us(timeout_us), active(std::move(act)) {
        if (R < 1 || E % R || T < 1 || H < 128 || H % 128 || max_topk < 1)
            throw std::invalid_argument("FastLL: bad buffer shape");
        if (!active.defined() || !active.is_cuda() || active.scalar_type() != at::kInt || active.numel() != R)
            throw std::invalid_argument("FastLL: active must be the backend's int32 [R] CUDA mask");
        shape.T = T;
        shape.H = H;
        shape.E = E;
        shape.R = R;
        shape.max_topk = max_topk;
        shape.dev_type = lc::kDevCUDA;
        shape.dev_index = device;
    }

    // A dispatch is taken with an error pending (EpBuffer raises recorded errors at the end of a combine,
    // at event waits and hooks: docs/ll_kernels.md); a combine is not, so that EpBuffer can tell the combine
    // of a dispatch that failed (skipped, nothing exchanged) from one that reports an older error.
    bool declines(bool combine) const {
        if (blocked) return true;
        if (combine && ((s.err && *reinterpret_cast<const volatile int32_t*>(s.err) != 0) ||
                        (s.call_err && *reinterpret_cast<const volatile int32_t*>(s.call_err) != 0)))
            return true;
        return pyep::bindings::empty_fills_memory();
    }

    uint64_t timeout_ns(const lc::Timeout& t) const {
        return static_cast<uint64_t>(t.kind == 1 ? t.value : default_timeout_us) * 1000ull;
    }

    uint64_t active_ptr(const lc::TensorArg& a) const {
        return a.present ? a.ptr : reinterpret_cast<uint64_t>(active.data_ptr());
    }

    // -> (recv_x, scales | None, recv_count, src_info, layout_range, handle extras, N, K) or None. The
    // extras are NativeBackend.dispatch's: {"backend": "native", "half", "topk_slot", "buffer"}.
    py::object dispatch(py::handle x_h, py::handle topk_h, py::handle fp8_h, py::handle round_h, py::handle ue8m0_h,
                        py::handle active_h, py::handle timeout_h, py::handle cum_h, py::handle wait_h, uint32_t seq) {
        if (declines(false)) return py::none();
        const lc::TensorArg x = meta_of(x_h.ptr()), topk = meta_of(topk_h.ptr()), act = meta_of(active_h.ptr()),
                            cum = meta_of(cum_h.ptr()), wait = meta_of(wait_h.ptr());
        const int fp8 = flag_of(fp8_h.ptr()), round_scale = flag_of(round_h.ptr()), ue8m0 = flag_of(ue8m0_h.ptr());
        const lc::Timeout timeout = timeout_of(timeout_h.ptr());
        if (lc::check_dispatch(shape, x, topk, act, cum, fp8, round_scale, ue8m0, 0, 0, timeout, wait) ||
            !lc::aligned16(x))
            return py::none();
        const int64_t n = x.sizes[0], k = topk.sizes[1];
        const int64_t el = shape.E / shape.R, rows = shape.R * shape.T, h = shape.H, r = shape.R;
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(shape.dev_index));
        // The half is consumed from here on, even if an allocation or the launch fails (the Python path
        // does the same): its state is unknown after a failure.
        const int used = half;
        half ^= 1;

        const auto recv_type = fp8 ? caffe2::TypeMeta::Make<c10::Float8_e4m3fn>() : caffe2::TypeMeta::Make<c10::BFloat16>();
        at::Tensor recv_x = over(new_storage(static_cast<size_t>(el * rows * h) * (fp8 ? 1 : 2)), recv_type,
                                 {el, rows, h}, {rows * h, h, 1}, 0);
        py::object scales = py::none();
        at::Tensor scales_t;
        if (fp8) {
            // Column-major per expert ([E_l, G, rows] transposed), as NativeBackend.dispatch allocates it.
            const int64_t groups = h / 128, cols = ue8m0 ? (groups + 3) / 4 : groups;
            scales_t = over(new_storage(static_cast<size_t>(el * rows * cols) * 4),
                            ue8m0 ? caffe2::TypeMeta::Make<int32_t>() : caffe2::TypeMeta::Make<float>(), {el, rows, cols},
                            {cols * rows, 1, rows}, 0);
        }
        // recv_count, src_info, recv_slot (int32) and layout_range (int64): disjoint views of one block.
        const int64_t words = el * (1 + 2 * rows), words8 = (words + 1) / 2;
        const c10::Storage meta = new_storage(static_cast<size_t>(words8 * 8 + el * r * 8));
        const auto i32 = caffe2::TypeMeta::Make<int32_t>();
        at::Tensor recv_count = over(meta, i32, {el}, {1}, 0);
        at::Tensor src_info = over(meta, i32, {el, rows}, {rows, 1}, el);
        at::Tensor recv_slot = over(meta, i32, {el, rows}, {rows, 1}, el * (1 + rows));
        at::Tensor layout_range = over(meta, caffe2::TypeMeta::Make<int64_t>(), {el, r}, {r, 1}, words8);

        LLDispatchCall c;
        c.x = x.ptr;
        c.topk = topk.ptr;
        c.num_tokens = static_cast<int>(n);
        c.num_topk = static_cast<int>(k);
        c.half = used;
        c.use_fp8 = fp8;
        c.round_scale = round_scale;
        c.use_ue8m0 = ue8m0;
        c.active = active_ptr(act);
        c.recv_x = reinterpret_cast<uint64_t>(recv_x.data_ptr());
        c.recv_scales = fp8 ? reinterpret_cast<uint64_t>(scales_t.data_ptr()) : 0;
        c.src_info = reinterpret_cast<uint64_t>(src_info.data_ptr());
        c.recv_slot = reinterpret_cast<uint64_t>(recv_slot.data_ptr());
        c.layout_range = reinterpret_cast<uint64_t>(layout_range.data_ptr());
        c.recv_count = reinterpret_cast<uint64_t>(recv_count.data_ptr());
        c.cum_stats = cum.present ? cum.ptr : 0;
        c.wait_stats = wait.present ? wait.ptr : 0;
        c.timeout_ns = timeout_ns(timeout);
        c.phases = pyep::ll::kPhaseSend | pyep::ll::kPhaseRecv;
        c.seq = seq;
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shape.dev_index).stream();
        pyep::ll::launch_dispatch(s, c, reinterpret_cast<uint64_t>(stream));
        ++calls;
        if (fp8) scales = py::cast(scales_t);
        return py::make_tuple(recv_x, scales, recv_count, src_info, layout_range, extras(used, std::move(recv_slot)), n, k);
    }

    py::dict extras(int used_half, at::Tensor recv_slot) const {
        // Interned keys, made once: the handle's dict costs four insertions per call.
        static PyObject* const k_backend = PyUnicode_InternFromString("backend");
        static PyObject* const k_half = PyUnicode_InternFromString("half");
        static PyObject* const k_slot = PyUnicode_InternFromString("topk_slot");
        static PyObject* const k_buffer = PyUnicode_InternFromString("buffer");
        static PyObject* const v_native = PyUnicode_InternFromString("native");
        py::dict d;
        PyDict_SetItem(d.ptr(), k_backend, v_native);
        PyDict_SetItem(d.ptr(), k_half, py::int_(used_half).ptr());
        PyDict_SetItem(d.ptr(), k_slot, py::cast(std::move(recv_slot)).ptr());
        PyDict_SetItem(d.ptr(), k_buffer, py::int_(s.buf).ptr());
        return d;
    }

    // -> out, or None. n, k, half and the three handle tensors come from a handle EpBuffer validated.
    py::object combine(py::handle x_h, py::handle topk_h, py::handle weights_h, py::handle src_info_h,
                       py::handle layout_range_h, py::handle recv_slot_h, int handle_half, int64_t n, int64_t k,
                       py::handle active_h, py::handle timeout_h, py::handle out_h, py::handle src_h,
                       py::handle wait_h, bool repeat, uint32_t seq) {
        if (declines(true) || (handle_half != 0 && handle_half != 1)) return py::none();
        const lc::TensorArg x = meta_of(x_h.ptr()), topk = meta_of(topk_h.ptr()), w = meta_of(weights_h.ptr()),
                            out = meta_of(out_h.ptr()), act = meta_of(active_h.ptr()), wait = meta_of(wait_h.ptr());
        const lc::Timeout timeout = timeout_of(timeout_h.ptr());
        if (lc::check_combine(shape, n, k, x, topk, w, out, act, 0, 0, 0, timeout, wait)) return py::none();
        // zero_copy: the rows come from the backend's combine buffer (src), x was still checked.
        const lc::TensorArg src = src_h.is_none() ? x : meta_of(src_h.ptr());
        const lc::TensorArg src_info = meta_of(src_info_h.ptr()), lr = meta_of(layout_range_h.ptr()),
                            slot = meta_of(recv_slot_h.ptr());
        if (!src.is_tensor || !lc::aligned16(src) || (out.present && !lc::aligned16(out)) || !src_info.is_tensor ||
            !lr.is_tensor || !slot.is_tensor)
            return py::none();
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(shape.dev_index));
        py::object result;
        uint64_t out_ptr = out.ptr;
        if (out.present) {
            result = py::reinterpret_borrow<py::object>(out_h);
        } else {
            at::Tensor o = over(new_storage(static_cast<size_t>(n * shape.H) * 2), caffe2::TypeMeta::Make<c10::BFloat16>(),
                                {n, shape.H}, {shape.H, 1}, 0);
            out_ptr = reinterpret_cast<uint64_t>(o.data_ptr());
            result = py::cast(std::move(o));
        }
        LLCombineCall c;
        c.x = src.ptr;
        c.topk = topk.ptr;
        c.weights = w.ptr;
        c.num_tokens = static_cast<int>(n);
        c.num_topk = static_cast<int>(k);
        c.half = handle_half;
        c.src_info = src_info.ptr;
        c.recv_slot = slot.ptr;
        c.layout_range = lr.ptr;
        c.active = active_ptr(act);
        c.out = out_ptr;
        c.wait_stats = wait.present ? wait.ptr : 0;
        c.timeout_ns = timeout_ns(timeout);
        c.phases = pyep::ll::kPhaseSend | pyep::ll::kPhaseRecv;
        c.seq = seq;
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shape.dev_index).stream();
        // A captured combine may be replayed on the same handle: it waits for the acknowledgements
        // like a repeated one (ll_ack.cuh; they are normally there already: one poll per destination).
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        c.repeat = (repeat || (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                               capture != cudaStreamCaptureStatusNone)) ? 1 : 0;
        pyep::ll::launch_combine(s, c, reinterpret_cast<uint64_t>(stream));
        ++calls;
        return result;
    }
};

void register_ep_fast(py::module_& m) {
    // Registered after part "ep" (parts run in name order), whose submodule and LLStatic it uses.
    py::module_ ep = m.attr("ep").cast<py::module_>();
    py::class_<FastLL>(ep, "FastLL",
                       "One binding call per low-latency dispatch / combine: checks, ATen outputs, launch on the "
                       "current stream. Returns None for a call it leaves to the Python path.")
        .def(py::init<const LLStatic&, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, at::Tensor>(),
             py::arg("static"), py::arg("device"), py::arg("T"), py::arg("H"), py::arg("E"), py::arg("R"),
             py::arg("max_topk"), py::arg("timeout_us"), py::arg("active"))
        .def_readwrite("static", &FastLL::s)
        .def_readwrite("half", &FastLL::half)
        .def_readwrite("blocked", &FastLL::blocked)
        .def_readonly("calls", &FastLL::calls)
        .def("dispatch", &FastLL::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("use_fp8"),
             py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("active_ranks"), py::arg("timeout_us"),
             py::arg("cumulative_local_expert_recv_stats"), py::arg("dispatch_wait_recv_cost_stats") = py::none(),
             py::arg("seq") = 0)
        .def("combine", &FastLL::combine, py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("src_info"), py::arg("layout_range"), py::arg("recv_slot"), py::arg("half"), py::arg("num_tokens"),
             py::arg("num_topk"), py::arg("active_ranks"), py::arg("timeout_us"), py::arg("out"), py::arg("src"),
             py::arg("combine_wait_recv_cost_stats") = py::none(), py::arg("repeat") = false, py::arg("seq") = 0);
}

pyep::bindings::Registrar reg("ep_fast", &register_ep_fast);

}  // namespace
#endif  // PYEP_WITH_CUDA
