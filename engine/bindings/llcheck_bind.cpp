// pyep._engine part "llcheck": the fast path's argument predicate (ll_argcheck.h) over metadata given
// from Python, in every build (CPU included), so tests can hold it against pyep/ep/validate.py without
// a GPU. Not on any hot path: the CUDA fast path (ep_fast_bind.cpp) calls the header directly.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings/ll_argcheck.h"
#include "bindings/registry.h"

namespace py = pybind11;
using namespace pyep::llcheck;

namespace {

// (is_tensor, dtype code, sizes, contiguous, device type code, device index, data_ptr) or None.
using Meta = std::optional<std::tuple<bool, int, std::vector<int64_t>, bool, int, int, uint64_t>>;

TensorArg arg_of(const Meta& m) {
    TensorArg t;
    if (!m) return t;
    t.present = true;
    const auto& [is_tensor, dtype, sizes, contiguous, dev_type, dev_index, ptr] = *m;
    t.is_tensor = is_tensor;
    t.dtype = dtype;
    t.dim = (int)sizes.size();
    for (int i = 0; i < t.dim && i < kMaxDims; ++i) t.sizes[i] = sizes[i];
    t.contiguous = contiguous;
    t.dev_type = dev_type;
    t.dev_index = dev_index;
    t.ptr = ptr;
    return t;
}

Shape shape_of(const std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int>& s) {
    Shape out;
    std::tie(out.T, out.H, out.E, out.R, out.max_topk, out.dev_type, out.dev_index) = s;
    if (out.R < 1) throw std::invalid_argument("llcheck: R must be >= 1");
    return out;
}

py::object verdict(const char* why) { return why ? py::object(py::str(why)) : py::object(py::none()); }

void register_llcheck(py::module_& m) {
    auto c = m.def_submodule("llcheck", "The LL fast path's argument predicate (tests hold it against validate.py)");
    c.def(
        "dispatch",
        [](const std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int>& shape, const Meta& x,
           const Meta& topk, const Meta& active, const Meta& cum, int use_fp8, int round_scale, int use_ue8m0,
           int async_finish, int return_recv_hook, std::pair<int, int64_t> timeout, bool check_align,
           const Meta& wait) {
            const Shape s = shape_of(shape);
            const TensorArg tx = arg_of(x);
            const char* why = check_dispatch(s, tx, arg_of(topk), arg_of(active), arg_of(cum), use_fp8, round_scale,
                                             use_ue8m0, async_finish, return_recv_hook,
                                             Timeout{timeout.first, timeout.second}, arg_of(wait));
            if (!why && check_align && !aligned16(tx)) why = "x alignment";
            return verdict(why);
        },
        py::arg("shape"), py::arg("x"), py::arg("topk"), py::arg("active"), py::arg("cum"), py::arg("use_fp8"),
        py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("async_finish"), py::arg("return_recv_hook"),
        py::arg("timeout"), py::arg("check_align") = true, py::arg("wait") = py::none(),
        "None if the fast path accepts the dispatch arguments, else the argument that declines them.");
    c.def(
        "combine",
        [](const std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int, int>& shape, int64_t n, int64_t k,
           const Meta& x, const Meta& topk, const Meta& weights, const Meta& out, const Meta& active, int zero_copy,
           int async_finish, int return_recv_hook, std::pair<int, int64_t> timeout, bool check_align,
           const Meta& wait) {
            const Shape s = shape_of(shape);
            const TensorArg tx = arg_of(x), tout = arg_of(out);
            const char* why = check_combine(s, n, k, tx, arg_of(topk), arg_of(weights), tout, arg_of(active),
                                            zero_copy, async_finish, return_recv_hook,
                                            Timeout{timeout.first, timeout.second}, arg_of(wait));
            if (!why && check_align && !aligned16(tx)) why = "x alignment";
            if (!why && check_align && tout.present && !aligned16(tout)) why = "out alignment";
            return verdict(why);
        },
        py::arg("shape"), py::arg("n"), py::arg("k"), py::arg("x"), py::arg("topk"), py::arg("weights"),
        py::arg("out"), py::arg("active"), py::arg("zero_copy"), py::arg("async_finish"),
        py::arg("return_recv_hook"), py::arg("timeout"), py::arg("check_align") = true, py::arg("wait") = py::none(),
        "None if the fast path accepts the combine arguments, else the argument that declines them.");
}

pyep::bindings::Registrar reg("llcheck", &register_llcheck);

}  // namespace
