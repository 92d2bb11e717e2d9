"""trtllm_mk: install with ``pip install .`` (``-e`` for development; add ``[test]`` for the test suite).

The C++ megakernel runtime (``trtllm_mk._mkrt``, pybind11, CUDA driver API) is built when nvcc / a
CUDA toolkit is found; without one the package still installs and imports, and everything that
needs the runtime says so when called.
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def cuda_home():
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if cand and Path(cand, "include", "cuda.h").exists():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "include" / "cuda.h").exists():
            return home
    if Path("/usr/local/cuda/include/cuda.h").exists():
        return Path("/usr/local/cuda")
    return None


def runtime_extension():
    if os.environ.get("TRTLLM_MK_NO_EXT"):
        return []
    home = cuda_home()
    if home is None:
        print("trtllm_mk: no CUDA toolkit found; building without the megakernel runtime", file=sys.stderr)
        return []
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        print("trtllm_mk: pybind11 missing; building without the megakernel runtime", file=sys.stderr)
        return []
    libdirs = [str(p) for p in (home / "lib64", home / "lib64" / "stubs", home / "targets" / "x86_64-linux" / "lib",
                                home / "targets" / "x86_64-linux" / "lib" / "stubs") if p.exists()]
    # The runtime links the CUDA driver library (or the toolkit's link stub); a toolkit without either
    # (compiler-only images) cannot link it, so the package installs without the runtime there.
    system = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu"]
    if not any(Path(d, "libcuda.so").exists() for d in libdirs + system):
        print("trtllm_mk: no libcuda.so (driver or toolkit stub) found; building without the megakernel runtime",
              file=sys.stderr)
        return []
    return [Pybind11Extension(
        "trtllm_mk._mkrt",
        ["trtllm_mk/runtime/csrc/megakernel_module.cpp", "trtllm_mk/runtime/csrc/bindings.cpp"],
        include_dirs=[str(home / "include"), "trtllm_mk/runtime/csrc"],
        library_dirs=libdirs,
        libraries=["cuda"],
        cxx_std=17,
    )]


class build_py_with_configs(build_py):
    """Ship the repository's configs/ (deployment YAMLs, architecture files) as trtllm_mk/configs."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "trtllm_mk" / "configs"
        for src in [*(ROOT / "configs").glob("*.yaml"), *(ROOT / "configs" / "models").glob("*.json")]:
            target = dest / src.relative_to(ROOT / "configs")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)


# Metadata, dependencies and package data are in pyproject.toml; this file adds the shipped configs
# and the optional compiled runtime, which needs a build-time probe for the CUDA toolkit.
setup(ext_modules=runtime_extension(), cmdclass={"build_py": build_py_with_configs})
