"""QuantScheme: what a checkpoint's ``quantization_config`` declares, in one form for every format, and
its name in TensorRT-LLM's ``QuantConfig`` terms (``quant_algo``, ``group_size``, ``has_zero_point``,
``exclude_modules``), which the deployment YAML's ``quantization`` section uses.
"""
from __future__ import annotations

from dataclasses import dataclass

PER_CHANNEL = -1     # group_size of one scale per output channel (HF's convention)
PER_TENSOR = 0       # group_size of one scale per weight matrix (FP8)

# TensorRT-LLM QuantAlgo names this engine can describe.
QUANT_ALGOS = ("W4A16_GPTQ", "W8A16_GPTQ", "W4A16_AWQ", "W4A16", "W8A16", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")


@dataclass(frozen=True)
class QuantScheme:
    method: str                      # checkpoint format: gptq | awq | compressed-tensors | modelopt
    weight_type: str                 # int | fp8
    bits: int                        # 4 or 8 (8 for FP8)
    group_size: int                  # input channels per scale; PER_CHANNEL or PER_TENSOR
    has_zero_point: bool             # integer formats: zero points stored per group
    desc_act: bool = False           # GPTQ: groups follow g_idx (activation order)
    variant: str = ""                # format detail: GPTQ checkpoint_format, AWQ version, CT format
    exclude_modules: tuple[str, ...] = ()   # modules the checkpoint leaves unquantized, as it names them

    @property
    def quant_algo(self) -> str:
        """TensorRT-LLM's QuantAlgo name of these weights."""
        if self.weight_type == "fp8":
            return "FP8" if self.group_size == PER_TENSOR else "FP8_PER_CHANNEL_PER_TOKEN"
        if self.method == "awq":
            return "W4A16_AWQ"
        if self.group_size == PER_CHANNEL:
            return f"W{self.bits}A16"
        return f"W{self.bits}A16_GPTQ"

    def describe(self) -> str:
        if self.weight_type == "fp8":
            scales = "per-tensor" if self.group_size == PER_TENSOR else "per-channel"
            return f"{self.quant_algo} (fp8 e4m3, {scales} scales; {self.method})"
        groups = "per-channel" if self.group_size == PER_CHANNEL else f"group {self.group_size}"
        zp = "zero points" if self.has_zero_point else "symmetric"
        order = ", act-order" if self.desc_act else ""
        return f"{self.quant_algo} (int{self.bits}, {groups}, {zp}{order}; {self.method})"

    def section(self) -> dict:
        """The deployment YAML's ``quantization`` section that describes these weights."""
        return {"quant_algo": self.quant_algo, "group_size": self.group_size,
                "has_zero_point": self.has_zero_point, "exclude_modules": list(self.exclude_modules)}
