"""ModelSpec: the shapes and numerics of a decoder-only transformer, read from an HF config.json.

Supported families (all share the Llama block: RMSNorm, GQA attention with RoPE, SwiGLU MLP):
  llama   - LlamaForCausalLM, incl. Llama 3.x "llama3" rope scaling
  mistral - MistralForCausalLM (sliding window must cover max_seq_len; checked by the config)
  qwen2   - Qwen2ForCausalLM: bias on q/k/v projections
  qwen3   - Qwen3ForCausalLM: RMSNorm on each q and k head before RoPE (QK-norm), explicit head_dim
  qwen3_moe - Qwen3MoeForCausalLM: Qwen3 whose sparse layers route each token to k of E experts
  mixtral - MixtralForCausalLM: Mistral whose every layer routes each token to k of E experts
A mixture-of-experts spec has ``num_experts > 0``; its sparse layers (``is_moe_layer``) hold a router
(``gate``, [E, hidden]) and E SwiGLU experts of ``moe_intermediate_size``; the other layers keep the
dense MLP of ``intermediate_size``. Dense specs leave these fields at their defaults, and their
``to_dict`` omits them, so the dense schedule format is unchanged.
Weights are named exactly as in HF checkpoints (see ``expected_tensors``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelError, read_json_object
from .families import FAMILIES

# HF "architectures" entry / "model_type" -> our family name.
_ARCH_FAMILY = {f.architecture: f.name for f in FAMILIES.values()}
_MODEL_TYPE_FAMILY = {f.model_type: f.name for f in FAMILIES.values()}
_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


# A sparse layer's router weight, under each mixture-of-experts family's MLP module (Qwen3-MoE's
# "mlp.gate", Mixtral's "block_sparse_moe.gate"): a small [E, H] matrix that stays in the model dtype
# when the layer linears are quantized, as quantization libraries leave it.
ROUTER_SUFFIXES = tuple(f".{f.moe_block}.gate.weight" for f in FAMILIES.values() if f.moe_block)


def is_router_weight(name: str) -> bool:
    return name.endswith(ROUTER_SUFFIXES)


def is_layer_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``name`` is a decoder layer's linear weight (not a router): what quantized checkpoints
    pack and the kernel streams quantized."""
    return len(shape) == 2 and name.startswith("model.layers.") and not is_router_weight(name)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str                      # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None  # HF dict, e.g. {"rope_type": "llama3", "factor": 32.0, ...}
    sliding_window: int | None = None
    dtype: str = "bfloat16"          # checkpoint dtype
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # mixture of experts (HF names); 0 experts: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False     # renormalise the k selected routing weights to sum to 1
    decoder_sparse_step: int = 1     # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()   # ... and i is not listed here
    # the decoder layers' linear weights as the megakernel streams them: 16 (bf16) or 4 (W4A16 in
    # quant/kernel_layout.py, ``weight_group`` input columns per scale); embeddings, norms and the LM
    # head stay in ``dtype``
    weight_bits: int = 16
    weight_group: int = 0
    # the model is one rank's share of a model split over this many GPUs (parallel/layout.py
    # rank_spec): its residual adds, LM-head maxima and the events that order them reach every rank
    tensor_parallel: int = 1

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family].qk_norm

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed experts (HF's rule for Qwen3-MoE; every layer of Mixtral)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def mlp_intermediate(self) -> int:
        """The width of a layer's MLP as the megakernel computes it: an expert's (every layer of an MoE
        model it builds is sparse) or the dense MLP's."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    def moe_slots(self, batch: int) -> int:
        """The megakernel's expert slots in a decode step of ``batch`` rows: the most distinct experts
        the rows can select, min(E, B * k)."""
        return min(self.num_experts, batch * self.num_experts_per_tok) if self.is_moe else 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def moe_names(self, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
        """Checkpoint names of a sparse layer's router weight and of each expert's (gate, up, down)."""
        fam = FAMILIES[self.family]
        blk = f"model.layers.{layer}.{fam.moe_block}."
        g, u, d = fam.expert_linears
        return blk + "gate.weight", [tuple(f"{blk}experts.{e}.{n}.weight" for n in (g, u, d))
                                     for e in range(self.num_experts)]

    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices."""
        H, Im = self.hidden_size, self.moe_intermediate_size
        return 2 * self.linear_bytes(Im, H) + self.linear_bytes(H, Im)

    def active_experts(self, batch: int = 1, worst_case: bool = False) -> float:
        """Distinct experts one sparse layer reads in a decode step of ``batch`` rows, each routed to
        k of E. Batch 1: k. Worst case: min(E, batch * k). Expected: E * (1 - (1 - k/E)^batch), each
        row choosing its k experts uniformly and independently of the others (real routers are
        skewed, which makes the expected count an upper estimate)."""
        E, k = self.num_experts, self.num_experts_per_tok
        if not self.is_moe:
            return 0.0
        if worst_case:
            return float(min(E, batch * k))
        return float(k) if batch == 1 else E * (1.0 - (1.0 - k / E) ** batch)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_bytes(self) -> int:
        return _DTYPES[self.dtype]

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold, by HF name, with its shape ([out, in] for linears)."""
        H, I, V = self.hidden_size, self.intermediate_size, self.vocab_size
        t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = (H,)
            t[p + "post_attention_layernorm.weight"] = (H,)
            t[p + "self_attn.q_proj.weight"] = (self.q_size, H)
            t[p + "self_attn.k_proj.weight"] = (self.kv_size, H)
            t[p + "self_attn.v_proj.weight"] = (self.kv_size, H)
            t[p + "self_attn.o_proj.weight"] = (H, self.q_size)
            if self.qkv_bias:
                t[p + "self_attn.q_proj.bias"] = (self.q_size,)
                t[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                t[p + "self_attn.v_proj.bias"] = (self.kv_size,)
            if self.qk_norm:
                t[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                t[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            if self.is_moe_layer(i):
                router, experts = self.moe_names(i)
                Im = self.moe_intermediate_size
                t[router] = (self.num_experts, H)
                for gate, up, down in experts:
                    t[gate] = (Im, H)
                    t[up] = (Im, H)
                    t[down] = (H, Im)
                continue
            t[p + "mlp.gate_proj.weight"] = (I, H)
            t[p + "mlp.up_proj.weight"] = (I, H)
            t[p + "mlp.down_proj.weight"] = (H, I)
        if not self.tie_word_embeddings:
            t["lm_head.weight"] = (V, H)
        return t

    def num_params(self) -> int:
        n = 0
        for shape in self.expected_tensors().values():
            k = 1
            for s in shape:
                k *= s
            n += k
        return n

    @property
    def quantized(self) -> bool:
        return self.weight_bits != 16

    def linear_bytes(self, out: int, k: int) -> int:
        """Bytes of one decoder-layer linear weight ``[out, k]`` as the kernel streams it (codes and
        scale words when quantized)."""
        if not self.quantized:
            return out * k * self.dtype_bytes
        return out * k * self.weight_bits // 8 + 4 * (-(-out // 16) * 16) * (k // self.weight_group)

    def weight_bytes(self) -> int:
        if not self.quantized:
            return self.num_params() * self.dtype_bytes
        total = 0
        for name, shape in self.expected_tensors().items():
            n = 1
            for s in shape:
                n *= s
            total += self.linear_bytes(*shape) if is_layer_linear(name, shape) else n * self.dtype_bytes
        return total

    def decode_weight_bytes(self, batch: int = 1, worst_case: bool = False) -> int:
        """Bytes one decode step of ``batch`` rows must read: every weight once; the embedding table
        contributes only its B looked-up rows (negligible) unless it is tied to the LM head; a sparse
        layer only its router and the experts its rows select (``active_experts``)."""
        total = self.weight_bytes()
        if not self.tie_word_embeddings:
            total -= self.vocab_size * self.hidden_size * self.dtype_bytes
        if self.is_moe:
            idle = self.num_experts - self.active_experts(batch, worst_case)
            total -= round(len(self.moe_layers) * idle * self.expert_bytes())
        return total

    def kv_bytes_per_token(self, kv_dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.kv_size * kv_dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.is_moe:
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        else:   # a dense spec writes what it always wrote (schedules and their checksums stay the same)
            for f in _MOE_FIELDS:
                del d[f]
        if not self.quantized:
            del d["weight_bits"], d["weight_group"]
        if self.tensor_parallel == 1:
            del d["tensor_parallel"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = tuple(d["mlp_only_layers"])
        return cls(**d)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers")


_MISSING = object()


def _req(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelError(f"{where}: config.json has no '{key}'")
    return cfg[key]


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _int(cfg: dict, key: str, where: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """A whole-number field of config.json, checked for type and range (JSON has no int type of its own,
    so 4096.0 is accepted; "4096", true and 4096.5 are not)."""
    v = _req(cfg, key, where) if default is _MISSING or cfg.get(key) is not None else default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ModelError(f"{where}: '{key}' must be a whole number, got {v!r}")
    if v < minimum:
        given = "" if cfg.get(key) is not None else " (derived: the key is absent)"
        raise ModelError(f"{where}: '{key}' is {v!r}{given}; it must be at least {minimum}")
    return int(v)


def _float(cfg: dict, key: str, where: str, default: float, positive: bool = True) -> float:
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ModelError(f"{where}: '{key}' must be a {'positive ' if positive else ''}finite number, got {v!r}")
    return float(v)


def _rope_settings(cfg: dict, where: str) -> tuple[float, dict | None, str]:
    """(rope_theta, scaling dict or None, where the scaling came from). transformers >= 5 writes rope
    settings under "rope_parameters" (theta and scaling in one object), older versions as top-level
    rope_theta and rope_scaling; where a config has both and they disagree, transformers versions read
    it differently, so it is refused rather than guessed."""
    rp = cfg.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ModelError(f"{where}: 'rope_parameters' must be an object, got {rp!r}")
    rs = cfg.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise ModelError(f"{where}: 'rope_scaling' must be an object or null, got {rs!r}")
    theta = _float(cfg, "rope_theta", where, 10000.0)
    if "rope_theta" in rp:
        new = _float(rp, "rope_theta", f"{where}: rope_parameters", theta)
        if cfg.get("rope_theta") is not None and new != theta:
            raise ModelError(f"{where}: rope_theta {theta:g} and rope_parameters.rope_theta {new:g} disagree "
                             "(transformers versions read them differently); keep one")
        theta = new

    def scaling(d):
        t = d.get("rope_type", d.get("type")) if d else None
        return None if t in (None, "default") else {k: v for k, v in d.items() if k != "rope_theta"}
    new, old = scaling(rp), scaling(rs)
    if new is not None and old is not None and new != old:
        raise ModelError(f"{where}: rope_parameters and rope_scaling describe different rope scaling "
                         "(transformers versions read them differently); keep one")
    if new is not None:
        return theta, rp, f"{where}: rope_parameters"
    return theta, rs, f"{where}: rope_scaling"


def _refuse_unimplemented(cfg: dict, family: str, where: str) -> None:
    """Numerics the megakernel does not compute are refused by name: building them would run wrong."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ModelError(f"{where}: hidden_act '{act}' is not implemented (the kernel's MLP is SiLU-gated)")
    if cfg.get("attention_bias") and not FAMILIES[family].qkv_bias:
        raise ModelError(f"{where}: attention_bias=true is not implemented for {family} (the kernel has no bias "
                         "on these projections)")
    if cfg.get("mlp_bias"):
        raise ModelError(f"{where}: mlp_bias=true is not implemented (the kernel's MLP has no bias)")
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    partial = cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ModelError(f"{where}: partial_rotary_factor={partial!r} is not implemented (the kernel rotates the "
                         "whole head)")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ModelError(f"{where}: pretraining_tp={cfg.get('pretraining_tp')!r} is not implemented (use 1)")


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ModelError(f"{where}: '{key}' must be true or false, got {v!r}")
    return v


def _moe_fields(cfg: dict, family: str, num_layers: int, where: str) -> dict[str, Any]:
    """The ModelSpec fields of a mixture-of-experts family's config; routing the engine does not
    compute (shared experts, a scoring function other than softmax) is refused by name."""
    fam = FAMILIES[family]
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if cfg.get(key):
            raise ModelError(f"{where}: {key}={cfg[key]!r}: shared experts are not implemented (only routed experts)")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ModelError(f"{where}: scoring_func '{scoring}' is not implemented (the router is a softmax over "
                         "the experts, then top-k)")
    # The published Qwen3-MoE configs say num_experts; transformers >= 5 writes num_local_experts (Mixtral's name).
    given = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(given) == 2 and given["num_experts"] != given["num_local_experts"]:
        raise ModelError(f"{where}: num_experts={given['num_experts']!r} and num_local_experts="
                         f"{given['num_local_experts']!r} disagree; keep one")
    if not given:
        raise ModelError(f"{where}: config.json has no 'num_experts' (or 'num_local_experts')")
    key = next(iter(given))
    E = _int(cfg, key, where)
    k = _int(cfg, "num_experts_per_tok", where)
    if k > E:
        raise ModelError(f"{where}: num_experts_per_tok={k} exceeds the {E} experts")
    if family == "mixtral":   # Mixtral's experts are its intermediate_size; every layer is sparse
        return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=_int(cfg, "intermediate_size", where),
                    norm_topk_prob=True)
    only = cfg.get("mlp_only_layers") or []
    if (not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only)
            or not all(0 <= i < num_layers for i in only)):
        raise ModelError(f"{where}: 'mlp_only_layers' must be a list of layer indices in 0..{num_layers - 1}, "
                         f"got {only!r}")
    return dict(num_experts=E, num_experts_per_tok=k,
                moe_intermediate_size=_int(cfg, "moe_intermediate_size", where),
                norm_topk_prob=fam.always_norm_topk or _bool(cfg, "norm_topk_prob", where, False),
                decoder_sparse_step=_int(cfg, "decoder_sparse_step", where, default=1),
                mlp_only_layers=tuple(sorted(set(only))))


def with_family_defaults(cfg: dict, family: str) -> dict:
    """``cfg`` with the family's transformers defaults (Family.config_defaults) for the keys it leaves
    out; a rope theta only where neither rope_theta nor rope_parameters gives one."""
    defaults = dict(FAMILIES[family].config_defaults)
    theta = defaults.pop("rope_theta", None)
    out = {**defaults, **cfg}
    rp = cfg.get("rope_parameters")
    if theta is not None and cfg.get("rope_theta") is None and not (isinstance(rp, dict) and rp.get("rope_theta") is not None):
        out["rope_theta"] = theta
    return out


def spec_from_hf_config(cfg: dict, name: str = "model", where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from the dict of an HF config.json; clear ModelError on anything else."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: expected a JSON object")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
    family = None
    for a in archs:
        family = _ARCH_FAMILY.get(a, family)
    if family is None and not archs:   # model_type names the family only where no architecture is given
        mt = cfg.get("model_type", "")
        family = _MODEL_TYPE_FAMILY.get(mt) if isinstance(mt, str) else None
    if family is None:
        got = archs[0] if archs else cfg.get("model_type", "<none>")
        raise ModelError(
            f"{where}: unsupported architecture '{got}'; supported: {', '.join(sorted(_ARCH_FAMILY))}")
    cfg = with_family_defaults(cfg, family)
    _refuse_unimplemented(cfg, family, where)
    H = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    nkv = _int(cfg, "num_key_value_heads", where, default=nh)
    head_dim = _int(cfg, "head_dim", where, default=H // nh if H >= nh else 0)
    if nh % nkv:
        raise ModelError(f"{where}: num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
    if head_dim % 16 or head_dim > 256:
        raise ModelError(f"{where}: head_dim={head_dim} unsupported (need a multiple of 16, at most 256)")
    rope_theta, rs, rs_where = _rope_settings(cfg, where)
    if rs is not None:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype not in ("llama3", "default", None):
            raise ModelError(f"{rs_where}: rope type '{rtype}' unsupported (supported: llama3)")
        if rtype in ("default", None):
            rs = None
        else:   # every llama3 key is required, as transformers requires them
            missing = [k for k in LLAMA3_ROPE_KEYS if rs.get(k) is None]
            if missing:
                raise ModelError(f"{rs_where}: llama3 rope scaling needs {', '.join(missing)}")
            for k in LLAMA3_ROPE_KEYS:
                _float(rs, k, rs_where, 1.0)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPES:
        raise ModelError(f"{where}: torch_dtype '{dtype}' unsupported (bfloat16, float16, float32)")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
        raise ModelError(f"{where}: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
    sw = cfg.get("sliding_window") if FAMILIES[family].reads_sliding_window else None
    if sw is not None:
        sw = _int(cfg, "sliding_window", where)
    if FAMILIES[family].rejects_use_sliding_window and cfg.get("use_sliding_window"):
        raise ModelError(f"{where}: use_sliding_window=true is unsupported")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ModelError(f"{where}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    num_layers = _int(cfg, "num_hidden_layers", where)
    moe = _moe_fields(cfg, family, num_layers, where) if FAMILIES[family].moe_block else {}
    return ModelSpec(
        name=name,
        family=family,
        hidden_size=H,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=num_layers,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", where),
        rms_norm_eps=_float(cfg, "rms_norm_eps", where, 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=_int(cfg, "max_position_embeddings", where, default=4096),
        tie_word_embeddings=tie,
        rope_scaling=dict(rs) if rs else None,
        sliding_window=sw or None,
        dtype=dtype,
        eos_token_ids=eos_ids,
        **moe,
    )


def load_spec(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a ModelSpec from a config.json file or a checkpoint directory that contains one."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.exists():
        raise ModelError(f"{cfg_path}: no such file (expected an HF config.json)")
    cfg = read_json_object(cfg_path, ModelError, "expected an HF config.json")
    return spec_from_hf_config(cfg, name=name or (p.name if p.is_dir() else p.stem), where=str(cfg_path))
