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
            return f"{self.quant_algo} (fp8 e4m3, {scales} scales; {self._source})"
        groups = "per-channel" if self.group_size == PER_CHANNEL else f"group {self.group_size}"
        zp = "zero points" if self.has_zero_point else "symmetric"
        order = ", act-order" if self.desc_act else ""
        return f"{self.quant_algo} (int{self.bits}, {groups}, {zp}{order}; {self._source})"

    @property
    def _source(self) -> str:
        return "as configured, no checkpoint" if self.method == "declared" else self.method

    def section(self) -> dict:
        """The deployment YAML's ``quantization`` section that describes these weights."""
        return {"quant_algo": self.quant_algo, "group_size": self.group_size,
                "has_zero_point": self.has_zero_point, "exclude_modules": list(self.exclude_modules)}

    # ---- bytes, for the memory budget, the decode floor and (later) the cost model ------------------
    def matrix_bytes(self, out: int, k: int, scale_bytes: int = 2) -> int:
        """Bytes of one quantized ``[out, k]`` weight matrix: codes, scales (``scale_bytes`` each; FP8
        scales are fp32) and zero codes."""
        if self.weight_type == "fp8":
            return out * k + 4 * (1 if self.group_size == PER_TENSOR else out)
        groups = 1 if self.group_size == PER_CHANNEL else -(-k // self.group_size)
        zeros = out * groups * self.bits // 8 if self.has_zero_point else 0
        return out * k * self.bits // 8 + out * groups * scale_bytes + zeros

    @property
    def quantizes_lm_head(self) -> bool:
        return not any("lm_head" in m for m in self.exclude_modules)

    @classmethod
    def from_section(cls, section: dict) -> "QuantScheme":
        """The scheme a deployment's ``quantization`` section declares when no checkpoint says more
        (a shapes-only model): the layout is left open (``method`` "declared")."""
        algo = section["quant_algo"]
        fp8 = algo.startswith("FP8")
        return cls(method="declared", weight_type="fp8" if fp8 else "int", bits=8 if fp8 or "W8" in algo else 4,
                   group_size=section["group_size"], has_zero_point=section["has_zero_point"],
                   exclude_modules=tuple(section["exclude_modules"]))


def quantized_weight_bytes(spec, scheme: QuantScheme, decode: bool = False) -> int:
    """Bytes of ``spec``'s weights with the decoder blocks' linear layers (and the LM head unless the
    scheme leaves it out) quantized by ``scheme``; ``decode``: those one decode step reads (the
    embedding table only through its looked-up rows, as ``ModelSpec.decode_weight_bytes``). Exclusions
    other than the LM head are not counted."""
    total = 0
    for name, shape in spec.expected_tensors().items():
        linear = len(shape) == 2 and (name.startswith("model.layers.") or
                                      (name == "lm_head.weight" and scheme.quantizes_lm_head))
        if name == "model.embed_tokens.weight" and decode and not spec.tie_word_embeddings:
            continue
        n = 1
        for s in shape:
            n *= s
        total += scheme.matrix_bytes(*shape) if linear else n * spec.dtype_bytes
    return total
