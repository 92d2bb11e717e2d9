"""Tiny random HF checkpoints (config.json + safetensors) for tests and smoke runs.

The default shapes are the smallest that still satisfy the megakernel's shape constraints
(``graph.builder.check_model_supported``), with GQA (4 query heads on 2 KV heads), so the same
directory exercises our loader, the reference decoder, HF transformers and the kernel.

    python -m trtllm_mk.model.tiny OUT_DIR --family qwen3 [--seed 0] [--shards 2] [--set KEY=JSON ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import ModelError, run_cli
from .random_weights import random_weights
from .spec import spec_from_hf_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")

_COMMON = {
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_dropout": 0.0,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

# Per-family keys, mirroring the published configs of each family (rope base, eps, tying).
_FAMILY = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        # Llama-3 frequency scaling with an original context (512) well inside max_position_embeddings,
        # so that at head_dim 32 some frequencies are divided, some smoothed and some kept.
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
        "tie_word_embeddings": True,  # as Llama-3.2-1B
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 2, "tie_word_embeddings": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 2, "tie_word_embeddings": False,
    },
    # 8 experts of 64 (2 per token, renormalised, as Qwen3-30B-A3B) on 3 layers, the middle one dense
    # (mlp_only_layers), so a checkpoint holds both kinds of MLP.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 3,
        "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 3, "tie_word_embeddings": False,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
}


def tiny_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The HF config.json dict of a tiny model of ``family``; ``overrides`` replace any key."""
    if family not in _FAMILY:
        raise ModelError(f"tiny checkpoint: unknown family '{family}'; choose one of {', '.join(FAMILIES)}")
    cfg = {**_COMMON, **_FAMILY[family], **overrides}
    if "max_window_layers" in cfg and "max_window_layers" not in overrides:
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def _split_into_shards(tensors: dict[str, torch.Tensor], shards: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of roughly equal bytes (HF shards by size the same way), none empty."""
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise ModelError(f"tiny checkpoint: shards={shards} must be between 1 and the tensor count {len(names)}")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    done, g = 0, 0
    for i, n in enumerate(names):
        # Move to the next shard once this one holds its share, but leave one tensor for each later shard.
        if groups[g] and g < shards - 1 and (done >= total * (g + 1) / shards or len(names) - i == shards - 1 - g):
            g += 1
        groups[g][n] = tensors[n]
        done += tensors[n].numel() * tensors[n].element_size()
    return groups


def write_tiny_checkpoint(out_dir: str | Path, family: str = "llama", seed: int = 0, shards: int = 1,
                          **overrides: Any) -> Path:
    """Write config.json + random bf16 weights (one file, or ``shards`` files with an index) to ``out_dir``."""
    cfg = tiny_config(family, **overrides)
    out = Path(out_dir)
    spec = spec_from_hf_config(cfg, name=out.name, where=f"tiny {family} config")
    tensors = random_weights(spec, dtype=torch.bfloat16, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    # A previous checkpoint written here with another shard count would leave files that loaders
    # pick up in preference to (or mixed with) the new ones.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map: dict[str, str] = {}
    for i, group in enumerate(_split_into_shards(tensors, shards)):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(group, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ModelError(f"--set '{text}': expected KEY=VALUE, e.g. --set num_hidden_layers=4")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string such as --set hidden_act=gelu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk.model.tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=JSON",
                    help="override a config.json key (value parsed as JSON), repeatable")
    args = ap.parse_args(argv)
    overrides = dict(_parse_override(s) for s in args.overrides)
    out = write_tiny_checkpoint(args.out_dir, family=args.family, seed=args.seed, shards=args.shards, **overrides)
    print(out)
    return 0


if __name__ == "__main__":
    run_cli(main)
