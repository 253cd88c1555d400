// Each binding file registers its part of pyep._engine here at static-initialisation time, so the
// module is assembled from whatever parts this build compiled (host-only or with CUDA).
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

namespace pyep {
namespace bindings {

using RegisterFn = void (*)(pybind11::module_&);

inline std::vector<std::pair<std::string, RegisterFn>>& registry() {
    static std::vector<std::pair<std::string, RegisterFn>> parts;
    return parts;
}

struct Registrar {
    Registrar(const char* name, RegisterFn fn) { registry().emplace_back(name, fn); }
};

}  // namespace bindings
}  // namespace pyep
