"""Random weights with a model's exact tensor names and shapes, generated on the target device.

Used for benchmarks on real shapes (no checkpoint needed) and, through ``tiny.py``, for the tiny test
checkpoints, so both follow one initialisation policy:
  - linears and embeddings: N(0, std), like HF's ``initializer_range``; a mixture-of-experts model's
    routers and every expert's matrices included (``ModelSpec.expected_tensors`` names them);
  - RMSNorm gains (incl. Qwen3's q/k norms): 1 + N(0, norm_noise), so a kernel that skips or
    misapplies a norm changes the output instead of multiplying by exactly 1;
  - biases (Qwen2 q/k/v): N(0, bias_std), large enough against the projection outputs (~std*sqrt(H))
    that a dropped bias is visible.

Tensors are filled in place (``empty`` + ``normal_``) by a generator living on ``device``: an 8B model
on a GPU never exists on the host and needs no fp32 temporaries. The same seed gives the same values
on the same device type; CPU and CUDA generators produce different streams.
"""
from __future__ import annotations

import torch

from .spec import ModelSpec

NORM_NOISE = 0.1
BIAS_STD = 0.1


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def random_weights(spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0, std: float = 0.02, norm_noise: float = NORM_NOISE,
                   bias_std: float = BIAS_STD) -> dict[str, torch.Tensor]:
    """Every tensor of ``spec.expected_tensors()`` (HF names, same order), random, on ``device``."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in spec.expected_tensors().items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if _is_norm(name):
            t.normal_(1.0, norm_noise, generator=gen)
        elif name.endswith(".bias"):
            t.normal_(0.0, bias_std, generator=gen)
        else:
            t.normal_(0.0, std, generator=gen)
        out[name] = t
    return out
