"""The package stands alone: a wheel holds the device sources, the runtime's C++ sources, the shipped
configs and architectures, the calibration files and the TensorRT plugin's sources and CMake project,
and nothing outside ``trtllm_mk``; installed
from it (not editable), ``python -m trtllm_mk build`` works in an empty folder on a copy of a shipped
config."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "p"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", ".cubin_cache",
                                                                           "__pycache__", "engines", ".hypothesis"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(src)], capture_output=True, text=True, env={**os.environ, "TRTLLM_MK_NO_EXT": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return next(out.glob("trtllm_mk-*.whl"))


@pytest.mark.slow
def test_wheel_holds_what_the_engine_needs_and_nothing_beside_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for need in ("trtllm_mk/device/mk_kernel.cuh", "trtllm_mk/device/mk_gemv.cuh", "trtllm_mk/kinds/attn.cuh",
                 "trtllm_mk/runtime/csrc/megakernel_module.cpp", "trtllm_mk/configs/l20_bs1.yaml",
                 "trtllm_mk/configs/models/qwen3-8b.json", "trtllm_mk/data/calibration/H100-SXM.json",
                 "trtllm_mk/data/calibration/L20.json", "trtllm_mk/plugin/CMakeLists.txt",
                 "trtllm_mk/plugin/trt/megakernel_plugin.cpp", "trtllm_mk/plugin/trt/kernel_json.h"):
        assert need in names, need
    tops = {n.split("/")[0] for n in names}
    assert tops == {"trtllm_mk", next(t for t in tops if t.endswith(".dist-info"))}, tops


@pytest.mark.slow
def test_installed_package_builds_a_shipped_config_in_an_empty_folder(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "empty"
    work.mkdir()
    shutil.copyfile(ROOT / "configs" / "tiny_cpu.yaml", work / "tiny_cpu.yaml")
    env = {**os.environ, "PYTHONPATH": str(site), "TRTLLM_MK_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "trtllm_mk", "build", "--config", "tiny_cpu.yaml", "--budget", "0.5"],
                       cwd=work, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (work / "engines" / "tiny_cpu" / "megakernel.cubin").is_file()
    probe = subprocess.run([sys.executable, "-c", "import trtllm_mk; print(trtllm_mk.__file__)"], cwd=work,
                           capture_output=True, text=True, env=env)
    assert probe.stdout.startswith(str(site)), probe.stdout   # the installed copy ran, not the source tree


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_installed_package_holds_the_tensorrt_plugin_sources(wheel, tmp_path):
    """The TensorRT plugin builds from an installed package: its CMake project, C++ sources and the
    seam header generator ship; the part that needs no TensorRT (the kernel.json reader) compiles."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    pkg = site / "trtllm_mk"
    assert (pkg / "plugin" / "CMakeLists.txt").is_file() and (pkg / "runtime" / "csrc" / "megakernel_module.h").is_file()
    gen = tmp_path / "gen"
    subprocess.run([sys.executable, "-I", str(pkg / "seam.py"), "--plugin-header", str(gen / "seam_generated.h")],
                   check=True, capture_output=True)
    trt = pkg / "plugin" / "trt"
    r = subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{trt}", f"-I{gen}",
                        str(trt / "kernel_json.cpp"), str(trt / "kernel_json_check.cpp"), "-o",
                        str(tmp_path / "kernel_json_check")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
