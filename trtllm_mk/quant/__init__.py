"""Quantized checkpoints: GPTQ, AWQ, compressed-tensors (pack-quantized W4A16/W8A16, float-quantized
FP8), ModelOpt FP8 and fbgemm_fp8, read into one canonical packed form per linear layer and
dequantized exactly as each format defines.

    scheme = read_scheme(ckpt_dir)                       # None for an unquantized checkpoint
    layers = load_quantized(ckpt_dir, spec, scheme)      # IntLinear / Fp8Linear per quantized layer
    tensors = load_dequantized(ckpt_dir, spec, scheme)   # what the reference and the CPU executor run

One module per format (gptq, awq, compressed_tensors, fp8) defines ``parse`` (its quantization_config
into a QuantScheme), ``read`` (its tensors into the canonical form), ``write`` and ``hf_config`` (the
way back, used by ``python -m trtllm_mk quantize``).
"""
from .detect import read_scheme, scheme_from_config
from .linear import Fp8Linear, IntLinear, QuantizedLinear
from .loader import check_quantized, load_dequantized, load_quantized
from .scheme import PER_CHANNEL, PER_TENSOR, QUANT_ALGOS, QuantScheme

__all__ = ["Fp8Linear", "IntLinear", "PER_CHANNEL", "PER_TENSOR", "QUANT_ALGOS", "QuantScheme", "QuantizedLinear",
           "check_quantized", "load_dequantized", "load_quantized", "read_scheme", "scheme_from_config"]
