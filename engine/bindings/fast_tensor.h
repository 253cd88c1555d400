// Output tensors of the C++ fast paths (ep_fast_bind.cpp, normal_fast_bind.cpp), made without torch's
// dispatcher: a storage from the CUDA caching allocator (what at::empty on CUDA uses) and tensors over
// parts of it. CUDA builds only (the extension is then a torch CUDAExtension).
#pragma once
#if defined(PYEP_WITH_CUDA)
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>

namespace pyep {
namespace bindings {

inline c10::Storage new_storage(size_t nbytes) {
    c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
    return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, a->allocate(nbytes), a, /*resizable=*/false);
}

// A tensor over (part of) a storage: what at::empty / narrow / view build, without the dispatcher.
inline at::Tensor over(const c10::Storage& st, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                       c10::IntArrayRef strides, int64_t offset) {
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(st), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                          dtype);
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
    return t;
}

// A new dense 2-D tensor [rows, cols].
inline at::Tensor empty_2d(caffe2::TypeMeta dtype, int64_t rows, int64_t cols) {
    return over(new_storage(static_cast<size_t>(rows * cols) * dtype.itemsize()), dtype, {rows, cols}, {cols, 1}, 0);
}

// torch.empty fills new memory when deterministic algorithms ask for it: a fast path leaves such calls
// to the Python path, which allocates through torch.
inline bool empty_fills_memory() {
    const auto& ctx = at::globalContext();
    return ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory();
}

}  // namespace bindings
}  // namespace pyep
#endif  // PYEP_WITH_CUDA
