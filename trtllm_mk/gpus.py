"""GPU catalog: the facts the shared-memory model, the cost model and codegen need per GPU type.

Datasheet sources:
  L20       NVIDIA L20 datasheet (Ada AD102, 92 SMs, 48 GB GDDR6 864 GB/s, 119.5 TFLOP/s dense
            FP16/BF16 tensor).
  L40S      NVIDIA L40S datasheet (142 SMs, 48 GB GDDR6 864 GB/s, 362 dense bf16 TFLOP/s).
  A100-80GB NVIDIA A100 datasheet (108 SMs, 80 GB HBM2e 2039 GB/s, 312 dense bf16 TFLOP/s).
  H100-SXM  NVIDIA H100 datasheet (132 SMs, 80 GB HBM3 3.35 TB/s, 989 dense bf16 TFLOP/s).
  H200      NVIDIA H200 datasheet (132 SMs, 141 GB HBM3e 4.8 TB/s, 989 dense bf16 TFLOP/s).
L2: A100 40 MB; H100 SXM and H200 both enable 50 MB of GH100's 60 MB (an H100 80GB HBM3 reports
52428800 bytes, 132 SMs, 227 KB opt-in smem per block).
Per-SM / per-block shared memory and registers: CUDA C Programming Guide, "Technical Specifications
per Compute Capability" (8.0: 164 KB/SM, 163 KB opt-in per block; 8.9: 100 KB/SM, 99 KB per block;
9.0: 228 KB/SM, 227 KB per block; 64 K 32-bit registers per SM for all three).
``read_bw_fraction``: the share of the datasheet bandwidth a streaming read reaches (measured on
H100 SXM: 3.08 of 3.35 TB/s, a device-to-device copy); the cost model uses ``hbm_bandwidth * read_bw_fraction``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import ConfigError

KB = 1024
GB = 10**9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    sm_count: int
    smem_per_sm: int              # bytes
    smem_per_block_optin: int     # bytes a block may use after cudaFuncSetAttribute
    regs_per_sm: int
    l2_bytes: int
    hbm_bytes: int
    hbm_bandwidth: float          # bytes/s, datasheet
    bf16_flops: float             # dense bf16 FLOP/s, datasheet
    compute_capability: tuple[int, int]
    nvcc_arch: str                # the -gencode target: sm_80, sm_89, sm_90a
    has_tma: bool                 # bulk async copies (cp.async.bulk) available
    read_bw_fraction: float = 0.90
    aliases: tuple[str, ...] = ()

    @property
    def read_bandwidth(self) -> float:
        """Achievable streaming read bandwidth (bytes/s) used by the cost model."""
        return self.hbm_bandwidth * self.read_bw_fraction

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        d["aliases"] = list(self.aliases)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GpuSpec":
        d = dict(d)
        d["compute_capability"] = tuple(d["compute_capability"])
        d["aliases"] = tuple(d.get("aliases", ()))
        return cls(**d)


CATALOG: dict[str, GpuSpec] = {g.name: g for g in [
    GpuSpec("L20", 92, 100 * KB, 99 * KB, 65536, 96 * 1024 * KB, 48 * GB, 864e9, 119.5e12, (8, 9), "sm_89",
            False, 0.90, ("l20", "nvidia l20")),
    GpuSpec("L40S", 142, 100 * KB, 99 * KB, 65536, 96 * 1024 * KB, 48 * GB, 864e9, 362e12, (8, 9), "sm_89",
            False, 0.90, ("l40s", "nvidia l40s")),
    GpuSpec("A100-80GB", 108, 164 * KB, 163 * KB, 65536, 40 * 1024 * KB, 80 * GB, 2039e9, 312e12, (8, 0),
            "sm_80", False, 0.90, ("a100", "a100-80gb", "a100-sxm4-80gb", "nvidia a100-sxm4-80gb")),
    GpuSpec("H100-SXM", 132, 228 * KB, 227 * KB, 65536, 50 * 1024 * KB, 80 * GB, 3.35e12, 989e12, (9, 0),
            "sm_90a", True, 3.08 / 3.35, ("h100", "h100-sxm", "h100 80gb hbm3", "nvidia h100 80gb hbm3")),
    GpuSpec("H200", 132, 228 * KB, 227 * KB, 65536, 50 * 1024 * KB, 141 * GB, 4.8e12, 989e12, (9, 0),
            "sm_90a", True, 0.90, ("h200", "nvidia h200")),
]}


def get_gpu(name: str) -> GpuSpec:
    """Catalog lookup by name or alias (case-insensitive); ``auto`` detects the local GPU."""
    if name.strip().lower() == "auto":
        return detect_gpu()
    key = name.strip().lower()
    for g in CATALOG.values():
        if key == g.name.lower() or key in g.aliases:
            return g
    raise ConfigError(f"gpu: unknown GPU '{name}'; known: {', '.join(CATALOG)} (or 'auto')")


def detect_gpu() -> GpuSpec:
    """The catalog entry of the local CUDA device 0; ConfigError when there is none or it is unknown."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        raise ConfigError("gpu: auto needs PyTorch to detect the GPU; name the GPU instead (e.g. gpu: H100-SXM)")
    if not torch.cuda.is_available():
        raise ConfigError("gpu: auto found no CUDA GPU on this machine; name the target GPU instead "
                          f"(one of {', '.join(CATALOG)})")
    dev = torch.cuda.get_device_name(0)
    cc = torch.cuda.get_device_capability(0)
    key = dev.lower()
    for g in CATALOG.values():
        if key == g.name.lower() or key in g.aliases:
            return g
    # Fall back on a family match (e.g. a differently worded H100 SXM name), but only when the SM count
    # and memory size agree too: an H100 PCIe (114 SMs, 2 TB/s) or an A100 40GB must not pass for the
    # catalog's SXM / 80GB part, whose SM count and bandwidth the schedule is built for.
    props = torch.cuda.get_device_properties(0)
    for g in CATALOG.values():
        fam = g.name.split("-")[0].lower()
        if (fam in key and tuple(cc) == g.compute_capability and props.multi_processor_count == g.sm_count
                and props.total_memory >= 0.9 * g.hbm_bytes):
            return g
    raise ConfigError(f"gpu: auto detected '{dev}' (sm_{cc[0]}{cc[1]}, {props.multi_processor_count} SMs), which "
                      f"is not in the catalog; name one of {', '.join(CATALOG)} or add it to trtllm_mk/gpus.py")
