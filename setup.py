"""trtllm_mk: install with ``pip install -e .`` (add ``[test]`` for the test suite).

The C++ megakernel runtime (``trtllm_mk._mkrt``, pybind11, CUDA driver API) is built when nvcc / a
CUDA toolkit is found; without one the package still installs and imports, and everything that
needs the runtime says so when called.
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


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


setup(
    name="trtllm_mk",
    version="0.1.0",
    description="Hybrid LLM inference engine: conventional prefill, one persistent CUDA megakernel per decode step",
    packages=find_packages(include=["trtllm_mk", "trtllm_mk.*"]),
    package_data={"trtllm_mk": ["../configs/**/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.14",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "matplotlib>=3.7",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6.80", "transformers>=4.45",
                 "openai>=1.40", "httpx>=0.27", "fastapi>=0.110", "uvicorn>=0.29", "scipy>=1.10"],
        "server": ["transformers>=4.45", "fastapi>=0.110", "uvicorn>=0.29"],   # tokenizer + HTTP server
    },
    ext_modules=runtime_extension(),
    entry_points={"console_scripts": ["trtllm-mk=trtllm_mk.__main__:main"]},
    zip_safe=False,
)
