"""GPU catalog: lookups by name and alias, ``auto`` detection (faked devices), and the catalog's facts."""
from types import SimpleNamespace

import pytest
import torch

from trtllm_mk.errors import ConfigError
from trtllm_mk.gpus import CATALOG, GB, KB, GpuSpec, detect_gpu, get_gpu


@pytest.mark.parametrize("name, expected", [
    ("L20", "L20"), ("l20", "L20"), ("  NVIDIA L20 ", "L20"), ("l40s", "L40S"), ("a100", "A100-80GB"),
    ("H100", "H100-SXM"), ("h100-sxm", "H100-SXM"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("h200", "H200")])
def test_lookup_by_name_or_alias(name, expected):
    assert get_gpu(name).name == expected


def test_unknown_gpu_lists_the_catalog():
    with pytest.raises(ConfigError, match=r"^gpu: unknown GPU 'B200'; known: L20, L40S, A100-80GB, H100-SXM, H200"):
        get_gpu("B200")


def test_auto_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^gpu: auto found no CUDA GPU on this machine; name the target GPU"):
        get_gpu("auto")


def fake_device(monkeypatch, name, cc, sms, memory):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cc)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: SimpleNamespace(multi_processor_count=sms, total_memory=memory))


@pytest.mark.parametrize("name, cc, sms, memory, expected", [
    ("NVIDIA H100 80GB HBM3", (9, 0), 132, 85_017_493_504, "H100-SXM"),   # as an H100 SXM reports itself
    ("NVIDIA H100 SXM5 80GB", (9, 0), 132, 85_017_493_504, "H100-SXM"),   # other wording, same part
    ("NVIDIA H200", (9, 0), 132, 150_754_820_096, "H200"),
    ("NVIDIA L20", (8, 9), 92, 48_305_799_168, "L20"),
])
def test_auto_detects_catalog_parts(monkeypatch, name, cc, sms, memory, expected):
    fake_device(monkeypatch, name, cc, sms, memory)
    assert detect_gpu().name == expected and get_gpu("auto").name == expected


@pytest.mark.parametrize("name, cc, sms, memory", [
    ("NVIDIA H100 PCIe", (9, 0), 114, 85_520_809_984),       # fewer SMs, 2 TB/s: not the SXM part
    ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42_505_273_344),  # half the memory of the catalog A100
    ("NVIDIA GeForce RTX 4090", (8, 9), 128, 25_393_692_672),
])
def test_auto_refuses_parts_that_only_resemble_the_catalog(monkeypatch, name, cc, sms, memory):
    fake_device(monkeypatch, name, cc, sms, memory)
    with pytest.raises(ConfigError, match=rf"^gpu: auto detected '{name}' .*{sms} SMs.*not in the catalog"):
        detect_gpu()


@pytest.mark.parametrize("gpu", CATALOG.values(), ids=list(CATALOG))
def test_catalog_facts_are_consistent(gpu):
    major, minor = gpu.compute_capability
    assert gpu.nvcc_arch == ("sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}")
    assert gpu.has_tma == (major >= 9)                      # cp.async.bulk / TMA arrived with sm_90
    assert gpu.smem_per_block_optin == gpu.smem_per_sm - 1 * KB  # 1 KB per block reserved by CUDA
    assert 0.5 < gpu.read_bw_fraction < 1 and gpu.read_bandwidth < gpu.hbm_bandwidth
    assert GpuSpec.from_dict(gpu.to_dict()) == gpu


def test_h100_entry_matches_the_measured_device():
    # torch.cuda.get_device_properties on an H100 80GB HBM3: 132 SMs, L2 52428800 B,
    # shared_memory_per_block_optin 232448 B, shared_memory_per_multiprocessor 233472 B.
    h = CATALOG["H100-SXM"]
    assert (h.sm_count, h.l2_bytes, h.smem_per_block_optin, h.smem_per_sm) == (132, 52428800, 232448, 233472)
    assert h.read_bandwidth == pytest.approx(3.08e12)        # the measured streaming read
    assert CATALOG["H200"].l2_bytes == h.l2_bytes and CATALOG["H200"].hbm_bytes == 141 * GB
