// The CPU simulations' Python side (tests/ll_sim/*.cpp): pybind11 as `py`, and kernel arguments read
// from dicts, where a field the kernel needs and the dict lacks is a KeyError naming it, never a zero.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

namespace py = pybind11;

namespace sim_args {

template <typename T>
void set(const pybind11::dict& d, const char* key, T& field) {
    if (!d.contains(key)) throw pybind11::key_error(std::string("missing field ") + key);
    field = d[key].cast<T>();
}

// A field with a default (the struct's own) when the dict lacks it.
template <typename T>
void opt(const pybind11::dict& d, const char* key, T& field) {
    if (d.contains(key)) field = d[key].cast<T>();
}

}  // namespace sim_args
