"""Build pyep._engine.

One extension module holds the whole native engine. Everywhere it contains the host-only parts
(PRM encoders, softnic, DevX host setup). Where a CUDA build of torch and nvcc are present (GPU
machines) it is built as a torch CUDAExtension and also holds the kernels in engine/**/*.cu.
Set PYEP_CUDA=0 to force the host-only build, PYEP_CUDA=1 to insist on CUDA, PYEP_CUDA_ARCH to pick
the target (default 90a). Kernels take raw pointers: no torch header is included in engine/kernels/;
the one binding that uses ATen (engine/bindings/ep_fast_bind.cpp, the LL fast path) is compiled only
in the CUDA build, where the extension is a torch CUDAExtension.
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
HOST_SOURCES = sorted(glob.glob("engine/mlx5gda/*.cpp") + glob.glob("engine/bindings/*.cpp"))
CUDA_SOURCES = sorted(glob.glob("engine/**/*.cu", recursive=True))
INCLUDES = [os.path.join(ROOT, "engine")]
CXX_FLAGS = ["-O2", "-std=c++17", "-Wall", "-Wno-unused-function", "-fvisibility=hidden"]
DEFINES = []
if os.path.exists("/usr/include/infiniband/mlx5dv.h"):
    # rdma-core headers present: static-assert our PRM layouts against them and build the DevX
    # provider (libibverbs/libmlx5 are dlopen'ed at run time, never linked).
    DEFINES.append(("PYEP_HAVE_RDMA_CORE", "1"))


def want_cuda() -> bool:
    flag = os.environ.get("PYEP_CUDA", "auto").lower()
    if flag in ("0", "no", "false"):
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
        ok = torch.version.cuda is not None and CUDA_HOME is not None
    except Exception:  # torch missing or broken: host-only build
        ok = False
    if flag in ("1", "yes", "true") and not ok:
        sys.exit("PYEP_CUDA=1 but no CUDA build of torch / CUDA_HOME was found")
    return ok


def make_extension():
    if want_cuda():
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension, library_paths
        arch = os.environ.get("PYEP_CUDA_ARCH", "90a")
        ext = CUDAExtension(
            name="pyep._engine",
            sources=HOST_SOURCES + CUDA_SOURCES,
            include_dirs=INCLUDES,
            define_macros=DEFINES + [("PYEP_WITH_CUDA", "1")],
            libraries=["cuda"],
            # CUDAExtension links libc10/libtorch; find them without requiring `import torch` first.
            extra_link_args=[f"-Wl,-rpath,{p}" for p in library_paths(device_type="cuda")],
            extra_compile_args={
                "cxx": CXX_FLAGS,
                "nvcc": ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                         "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-v" if os.environ.get("PYEP_PTXAS_V") else "-DPYEP_QUIET"],
            },
        )
        return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
    ParallelCompile("PYEP_JOBS", default=0).install()
    ext = Pybind11Extension(
        "pyep._engine",
        sources=HOST_SOURCES,
        include_dirs=INCLUDES,
        define_macros=DEFINES,
        extra_compile_args=CXX_FLAGS,
        cxx_std=17,
    )
    return [ext], {"build_ext": build_ext}


class build_py(_build_py):
    """Ships configs/*.yaml inside the package (pyep/configs/), where `pyep launch NAME` finds them in an
    installed pyep (pyep/config/bundled.py); the checkout keeps them in configs/, where users look."""

    def run(self) -> None:
        super().run()
        dest = os.path.join(self.build_lib, "pyep", "configs")
        self.mkpath(dest)
        configs = os.path.join(ROOT, "configs")
        for src in sorted(glob.glob(os.path.join(configs, "*.yaml"))) + [os.path.join(configs, "README.md")]:
            self.copy_file(src, os.path.join(dest, os.path.basename(src)))


ext_modules, cmdclass = make_extension()
setup(ext_modules=ext_modules, cmdclass=dict(cmdclass, build_py=build_py))
