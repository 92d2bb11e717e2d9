"""Compile generated megakernel source to a cubin with nvcc, cached by content hash.

The cache key covers the source, the target and the nvcc version, so a rebuild of the same engine
costs nothing. Cache directory: $TRTLLM_MK_CACHE or ~/.cache/trtllm_mk/cubin; ptxas's resource report
(``-Xptxas -v``: registers, stack, spills; ptxas.py parses it) is kept beside each cubin as
``KEY.ptxas.txt``, so a cache hit knows its spills too (a cubin without its report is compiled again).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import struct
import subprocess
import tempfile
from pathlib import Path

from ..errors import EngineError

SUPPORTED_ARCHS = {"sm_80": "compute_80", "sm_89": "compute_89", "sm_90a": "compute_90a"}


def cubin_sm(path: Path) -> int:
    """The SM version a cubin's machine code is for, read from its ELF header (EM_CUDA; the version is
    in e_flags: bits 8-15 from ELF ABI version 8 on, bits 0-7 before)."""
    try:
        head = Path(path).read_bytes()[:64]
    except OSError as e:
        raise EngineError(f"{path}: cannot be read ({e.strerror})") from None
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] != 2 or struct.unpack_from("<H", head, 18)[0] != 190:
        raise EngineError(f"{path}: not a CUDA cubin (no 64-bit ELF for EM_CUDA); rebuild the engine")
    flags = struct.unpack_from("<I", head, 48)[0]
    return (flags >> 8) & 0xFF if head[8] >= 8 else flags & 0xFF


def arch_sm(arch: str) -> int:
    """sm_90a -> 90."""
    return int(arch[3:5])


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


def _die_with_parent() -> None:
    """In the compiler's process: receive SIGKILL when the build process dies (Linux), so a killed
    build does not leave nvcc running."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_compiler(cmd: list[str], tmpdir: str | None = None) -> tuple[int, str]:
    """Run nvcc in a process group of its own; an exception here (Ctrl-C, SIGTERM turned into one by the
    builder) kills the whole group (nvcc and the cicc / ptxas it started) before it propagates."""
    # $TRTLLM_MK_NVCC_LAUNCHER: a command that runs the compiler (ccache, nice, ...), as CMake's
    # CMAKE_CUDA_COMPILER_LAUNCHER; the tests use it to stand in a slow compiler
    cmd = os.environ.get("TRTLLM_MK_NVCC_LAUNCHER", "").split() + cmd
    # nvcc's intermediate files go to $TMPDIR; in a folder the caller removes, a killed compile leaves none
    env = dict(os.environ, TMPDIR=tmpdir) if tmpdir else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_die_with_parent, env=env)
    try:
        _, stderr = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return proc.returncode, stderr


def compile_cubin(source: str, arch: str, out_path: Path | None = None, debug: bool = False) -> tuple[Path, str]:
    """Compile ``source`` for ``arch``; returns (cubin path, ptxas resource report). Cached."""
    nvcc = find_nvcc()
    flags = nvcc_flags(arch, debug)
    key = hashlib.sha256("\0".join([source, arch, nvcc_version(nvcc), *flags]).encode()).hexdigest()[:24]
    cached = cache_dir() / f"{key}.cubin"
    report_path = cached.with_suffix(".ptxas.txt")
    if not (cached.exists() and report_path.exists()):
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "megakernel.cu"
            src.write_text(source)
            tmp_out = Path(tmp) / "megakernel.cubin"
            returncode, stderr = _run_compiler([nvcc, *flags, "-o", str(tmp_out), str(src)], tmpdir=tmp)
            if returncode != 0:
                tail = "\n".join(stderr.strip().splitlines()[-30:])
                raise RuntimeError(f"nvcc failed for {arch} (this is a code-generation bug):\n{tail}")
            report_path.write_text(stderr)
            shutil.move(str(tmp_out), cached)
    if out_path is not None:
        shutil.copyfile(cached, out_path)
    return (out_path or cached), report_path.read_text()
