"""Compile generated megakernel source to a cubin with nvcc, cached by content hash.

The cache key covers the source, the target and the nvcc version, so a rebuild of the same engine
costs nothing. Cache directory: $TRTLLM_MK_CACHE or ~/.cache/trtllm_mk/cubin.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import EngineError

SUPPORTED_ARCHS = {"sm_80": "compute_80", "sm_89": "compute_89", "sm_90a": "compute_90a"}


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for cand in ("/usr/local/cuda/bin/nvcc",):
            if Path(cand).exists():
                return cand
        raise EngineError("nvcc not found: install the CUDA toolkit (12.4 or newer) or put nvcc on PATH "
                          "to compile the megakernel")
    return nvcc


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def cache_dir() -> Path:
    d = Path(os.environ.get("TRTLLM_MK_CACHE", Path.home() / ".cache" / "trtllm_mk" / "cubin"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def nvcc_flags(arch: str, debug: bool = False) -> list[str]:
    if arch not in SUPPORTED_ARCHS:
        raise EngineError(f"GPU target {arch} is not supported by the megakernel (supported: "
                          f"{', '.join(SUPPORTED_ARCHS)})")
    flags = ["-cubin", "-std=c++17", f"-gencode=arch={SUPPORTED_ARCHS[arch]},code={arch}", "-Xptxas", "-v"]
    flags += ["-G", "-lineinfo", "-O0"] if debug else ["-O3", "-lineinfo"]
    return flags


def compile_cubin(source: str, arch: str, out_path: Path | None = None, debug: bool = False) -> tuple[Path, str]:
    """Compile ``source`` for ``arch``; returns (cubin path, ptxas resource report). Cached."""
    nvcc = find_nvcc()
    flags = nvcc_flags(arch, debug)
    key = hashlib.sha256("\0".join([source, arch, nvcc_version(nvcc), *flags]).encode()).hexdigest()[:24]
    cached = cache_dir() / f"{key}.cubin"
    report_path = cached.with_suffix(".ptxas.txt")
    if not cached.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "megakernel.cu"
            src.write_text(source)
            tmp_out = Path(tmp) / "megakernel.cubin"
            proc = subprocess.run([nvcc, *flags, "-o", str(tmp_out), str(src)], capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
                raise RuntimeError(f"nvcc failed for {arch} (this is a code-generation bug):\n{tail}")
            report_path.write_text(proc.stderr)
            shutil.move(str(tmp_out), cached)
    if out_path is not None:
        shutil.copyfile(cached, out_path)
    report = report_path.read_text() if report_path.exists() else ""
    return (out_path or cached), report
