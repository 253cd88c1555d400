// pyep._engine: assembled from the parts registered in registry.h.
#include <algorithm>

#include "bindings/registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_engine, m) {
    m.doc() = "pyep native engine: mlx5 GDA primitives, softnic, DevX host setup, CUDA kernels";
#if defined(PYEP_WITH_CUDA)
    m.attr("has_cuda") = true;
#else
    m.attr("has_cuda") = false;
#endif
#if defined(PYEP_HAVE_RDMA_CORE)
    m.attr("has_rdma_core") = true;
#else
    m.attr("has_rdma_core") = false;
#endif
    auto parts = pyep::bindings::registry();
    std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    py::list names;
    for (auto& [name, fn] : parts) {
        fn(m);
        names.append(name);
    }
    m.attr("parts") = names;
}
