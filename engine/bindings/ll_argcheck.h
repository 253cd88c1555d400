// The argument rules of a low-latency dispatch / combine call, as a predicate over tensor metadata, for
// the C++ fast path of the native backend (ep_fast_bind.cpp). pyep/ep/validate.py is the statement of
// the rules and the source of every error message: this file mirrors it as "accept or decline". A
// declined call goes to the Python path, which raises validate.py's TypeError/ValueError (or, where
// this predicate is merely conservative, performs the call). So the predicate must never accept a call
// validate.py rejects; tests/test_ep_fastpath.py feeds the same inputs to both (llcheck_bind.cpp
// exposes this header in every build, CPU included).
//
// No torch header here: metadata arrives as plain values (dtype and device type are c10::ScalarType /
// c10::DeviceType codes; ep_fast_bind.cpp static_asserts the ones used).
#pragma once

#include <stdint.h>

#include <initializer_list>

namespace pyep {
namespace llcheck {

constexpr int kInt32 = 3;      // c10::ScalarType::Int
constexpr int kInt64 = 4;      // c10::ScalarType::Long
constexpr int kFloat32 = 6;    // c10::ScalarType::Float
constexpr int kBFloat16 = 15;  // c10::ScalarType::BFloat16
constexpr int kDevCPU = 0;     // c10::DeviceType::CPU
constexpr int kDevCUDA = 1;    // c10::DeviceType::CUDA
constexpr int kMaxDims = 8;
constexpr int kMaxTopk = 16;   // config.MAX_TOPK (the buffer's max_topk is <= this)

// One argument. present = false: the caller passed None.
struct TensorArg {
    bool present = false;
    bool is_tensor = false;       // a strided torch.Tensor (anything else: declined)
    int dtype = -1;
    int dim = 0;
    int64_t sizes[kMaxDims] = {};
    bool contiguous = false;
    int dev_type = -1;
    int dev_index = -1;           // -1: no index (CPU)
    uint64_t ptr = 0;             // data_ptr()
};

// A bool flag: 0 / 1, or -1 for anything that is not a Python bool (validate.check_bool's TypeError).
// A timeout: kind 0 None (the buffer's default), 1 an int (value), 2 anything else (bool included).
struct Timeout {
    int kind = 0;
    int64_t value = 0;
};

// The buffer: T, H, E, R, max_topk and its device.
struct Shape {
    int64_t T = 0, H = 0, E = 0, R = 1, max_topk = 0;
    int dev_type = kDevCUDA, dev_index = 0;
};

// validate.check_tensor (contiguous=True).
inline bool tensor_ok(const TensorArg& t, int dtype, std::initializer_list<int64_t> shape, const Shape& s) {
    if (!t.is_tensor || t.dtype != dtype || t.dim != (int)shape.size() || t.dim > kMaxDims) return false;
    int i = 0;
    for (int64_t want : shape) {
        if (want >= 0 && t.sizes[i] != want) return false;
        ++i;
    }
    return t.dev_type == s.dev_type && t.dev_index == s.dev_index && t.contiguous;
}

// pyep/ep/ll/validate.check_timeout: an int in [1, MAX_TIMEOUT_US] (pyep/ep/ll/config.py: an hour).
constexpr int64_t kMaxTimeoutUs = 3600000000ll;
inline bool timeout_ok(const Timeout& t) {
    return t.kind == 0 || (t.kind == 1 && t.value > 0 && t.value <= kMaxTimeoutUs);
}

// The kernels move rows with 16-byte vector accesses (NativeBackend._check_aligned).
inline bool aligned16(const TensorArg& t) { return t.ptr % 16 == 0; }

// validate.check_wait_stats: *_wait_recv_cost_stats, int64 [R].
inline bool wait_stats_ok(const TensorArg& w, const Shape& s) { return !w.present || tensor_ok(w, kInt64, {s.R}, s); }

// validate.validate_dispatch. nullptr: accepted; else the argument that declines it.
inline const char* check_dispatch(const Shape& s, const TensorArg& x, const TensorArg& topk, const TensorArg& active,
                                  const TensorArg& cum, int use_fp8, int round_scale, int use_ue8m0, int async_finish,
                                  int return_recv_hook, const Timeout& timeout, const TensorArg& wait = TensorArg()) {
    for (int f : {use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook})
        if (f != 0 && f != 1) return "flag";
    if (use_ue8m0 && !round_scale) return "use_ue8m0";
    if ((round_scale || use_ue8m0) && !use_fp8) return "round_scale";
    if (async_finish && return_recv_hook) return "async_finish";
    if (!tensor_ok(x, kBFloat16, {-1, s.H}, s)) return "x";
    const int64_t n = x.sizes[0];
    if (n > s.T) return "x";
    if (!topk.is_tensor || topk.dim != 2) return "topk_idx";
    const int64_t k = topk.sizes[1];
    if (k < 1 || k > s.max_topk || k > kMaxTopk) return "topk_idx";
    if (!tensor_ok(topk, kInt64, {n, k}, s)) return "topk_idx";
    if (active.present && !tensor_ok(active, kInt32, {s.R}, s)) return "active_ranks";
    if (cum.present && !tensor_ok(cum, kInt32, {s.E / s.R}, s)) return "cumulative_local_expert_recv_stats";
    if (!wait_stats_ok(wait, s)) return "dispatch_wait_recv_cost_stats";
    if (!timeout_ok(timeout)) return "timeout_us";
    return nullptr;
}

// validate.validate_combine, less the handle's own checks (validate_handle runs before: n and k are
// the handle's N and K).
inline const char* check_combine(const Shape& s, int64_t n, int64_t k, const TensorArg& x, const TensorArg& topk,
                                 const TensorArg& weights, const TensorArg& out, const TensorArg& active,
                                 int zero_copy, int async_finish, int return_recv_hook, const Timeout& timeout,
                                 const TensorArg& wait = TensorArg()) {
    for (int f : {zero_copy, async_finish, return_recv_hook})
        if (f != 0 && f != 1) return "flag";
    if (async_finish && return_recv_hook) return "async_finish";
    if (!tensor_ok(x, kBFloat16, {s.E / s.R, s.R * s.T, s.H}, s)) return "x";
    if (!tensor_ok(topk, kInt64, {n, k}, s)) return "topk_idx";
    if (!tensor_ok(weights, kFloat32, {n, k}, s)) return "topk_weights";
    if (out.present && !tensor_ok(out, kBFloat16, {n, s.H}, s)) return "out";
    if (active.present && !tensor_ok(active, kInt32, {s.R}, s)) return "active_ranks";
    if (!wait_stats_ok(wait, s)) return "combine_wait_recv_cost_stats";
    if (!timeout_ok(timeout)) return "timeout_us";
    return nullptr;
}

}  // namespace llcheck
}  // namespace pyep
