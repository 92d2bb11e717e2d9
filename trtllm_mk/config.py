"""Deployment config: the YAML that fixes the model, the GPU, the batch and the sequence limits of one
engine, read strictly and resolved (model spec, GPU spec) at load time.

Keys mirror TensorRT-LLM's LLM API where the meaning is the same (``max_batch_size``, ``max_seq_len``,
``max_input_len``, ``max_num_tokens``, ``kv_cache_config``, ``cuda_graph_config``); our own sections
are ``prefill`` and ``megakernel``; ``tensor_parallel_size`` is TensorRT-LLM's (the GPUs of one host
that share each layer; the memory budget is per GPU); ``quantization`` uses the names of TensorRT-LLM's ``QuantConfig``
(``quant_algo``, ``group_size``, ``has_zero_point``, ``exclude_modules``) and is filled from, and checked
against, the checkpoint's ``quantization_config``. TensorRT-LLM rejects unknown keys, so ``trtllm_llm_kwargs`` hands
it only its own. Every mistake is one ConfigError of the form ``<file>: <dotted.key>: <what and fix>``.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .deployment import MemoryBudget, memory_budget
from .errors import ConfigError, ModelError, UserError, read_json_object
from .gpus import CATALOG, GB, GpuSpec, get_gpu
from .graph import MAX_BATCH, check_kernel_supported
from .model.registry import REPO_CONFIG_DIR, resolve_model
from .model.spec import ModelSpec
from .parallel.layout import TP_SIZES, check_tensor_parallel, rank_spec
from .quant.kernel_support import UnsupportedQuantization, quantized_spec
from .quant.scheme import PER_CHANNEL, PER_TENSOR, QUANT_ALGOS, QuantScheme

DEFAULT_CONFIG = REPO_CONFIG_DIR / "l20_bs1.yaml"

DTYPE_BYTES = {"bfloat16": 2}
PREFILL_BACKENDS = ("auto", "torch", "tensorrt_llm")
MEGAKERNEL_MODES = ("static", "dynamic")
KV_CACHE_DTYPES = ("bfloat16", "auto")   # TensorRT-LLM's "auto" = the model dtype, bfloat16 here

# Allowed keys per section; also the index for "did you mean <section>.<key>?" across sections.
SCHEMA: dict[str, tuple[str, ...]] = {
    "": ("name", "model", "gpu", "dtype", "max_batch_size", "max_seq_len", "max_input_len", "max_num_tokens",
         "kv_cache_config", "cuda_graph_config", "prefill", "megakernel", "quantization", "tensor_parallel_size"),
    "kv_cache_config": ("tokens_per_block", "dtype", "free_gpu_memory_fraction"),
    "prefill": ("backend",),
    "megakernel": ("mode", "search_budget_s", "seed", "output_dir", "context_len", "allow_spills",
                   "max_plan_attempts"),
    "quantization": ("quant_algo", "group_size", "has_zero_point", "exclude_modules"),
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REQUIRED = object()


@dataclass(frozen=True)
class KvCacheConfig:
    tokens_per_block: int = 32
    dtype: str = "bfloat16"
    free_gpu_memory_fraction: float = 0.9


@dataclass(frozen=True)
class PrefillConfig:
    backend: str = "auto"            # auto | torch | tensorrt_llm; auto resolves where the engine runs


@dataclass(frozen=True)
class MegakernelConfig:
    output_dir: Path
    context_len: int                 # context length the cost model optimises the schedule for
    mode: str = "static"
    search_budget_s: float = 60.0
    seed: int = 0
    # A plan whose kernel spills registers is skipped for the next ranked plan, up to this many
    # plans compiled; when all of them spill the build fails, unless allow_spills ships the best one.
    max_plan_attempts: int = 6
    allow_spills: bool = False


@dataclass(frozen=True)
class DeploymentConfig:
    name: str
    model: str                       # architecture name, or an absolute checkpoint / config.json path
    gpu: str                         # catalog name ("auto" already resolved)
    dtype: str
    max_batch_size: int
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int
    kv_cache_config: KvCacheConfig
    cuda_graph_config: dict | None   # {}: TensorRT-LLM's default; None: CUDA graphs off (TRT-LLM's null)
    prefill: PrefillConfig
    megakernel: MegakernelConfig
    model_spec: ModelSpec = field(repr=False)  # as the kernel streams it: weight_bits 4 for W4A16 (kernel_spec)
    gpu_spec: GpuSpec = field(repr=False)
    checkpoint_dir: Path | None = field(default=None, repr=False)  # None: shapes only (random weights)
    model_source: str = field(default="", repr=False)              # where the spec was read from
    quantization: dict | None = None  # the quantization section in YAML form; None: bf16 weights
    # what the checkpoint declares (or, for a shapes-only model, the section): None for bf16 weights
    quant_scheme: QuantScheme | None = field(default=None, repr=False)
    tensor_parallel_size: int = 1    # GPUs of one host sharing every layer (trtllm_mk.parallel)
    source: Path | None = field(default=None, compare=False)       # the YAML file, if any

    @property
    def rank_spec(self) -> ModelSpec:
        """The part of the model one GPU holds (the whole model without tensor parallelism)."""
        return rank_spec(self.model_spec, self.tensor_parallel_size)

    def memory_budget(self) -> MemoryBudget:
        """What one GPU holds: its weight shard, its KV heads' cache, its prefill activations."""
        kv = self.kv_cache_config
        return memory_budget(self.rank_spec, self.gpu_spec, max_batch_size=self.max_batch_size,
                             max_seq_len=self.max_seq_len, max_num_tokens=self.max_num_tokens,
                             tokens_per_block=kv.tokens_per_block,
                             free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
                             kv_dtype_bytes=DTYPE_BYTES["bfloat16"], weight_bytes=self.quantized_weight_bytes())

    def quantized_weight_bytes(self) -> int | None:
        """Resident bytes of the quantized weights; None for bf16 weights."""
        if self.quant_scheme is None:
            return None
        from .quant.scheme import quantized_weight_bytes
        return quantized_weight_bytes(self.rank_spec, self.quant_scheme)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config in YAML form; ``parse_config(cfg.to_dict())`` gives an equal config."""
        kv, mk = self.kv_cache_config, self.megakernel
        return {
            "name": self.name, "model": self.model, "gpu": self.gpu, "dtype": self.dtype,
            "max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
            "max_input_len": self.max_input_len, "max_num_tokens": self.max_num_tokens,
            "kv_cache_config": {"tokens_per_block": kv.tokens_per_block, "dtype": kv.dtype,
                                "free_gpu_memory_fraction": kv.free_gpu_memory_fraction},
            "cuda_graph_config": copy.deepcopy(self.cuda_graph_config),
            "prefill": {"backend": self.prefill.backend},
            "megakernel": {"mode": mk.mode, "search_budget_s": mk.search_budget_s, "seed": mk.seed,
                           "output_dir": str(mk.output_dir), "context_len": mk.context_len,
                           "allow_spills": mk.allow_spills, "max_plan_attempts": mk.max_plan_attempts},
            **({"quantization": copy.deepcopy(self.quantization)} if self.quantization is not None else {}),
            **({"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size != 1 else {}),
        }

    def trtllm_llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``tensorrt_llm.LLM`` (besides ``model``, which the caller passes):
        our own sections and keys are left out because TensorRT-LLM rejects unknown keys."""
        kw: dict[str, Any] = {
            "dtype": self.dtype, "max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
            "max_input_len": self.max_input_len, "max_num_tokens": self.max_num_tokens,
            # KvCacheConfig.dtype takes "auto" (the model dtype) or a quantized type such as "fp8".
            "kv_cache_config": {"tokens_per_block": self.kv_cache_config.tokens_per_block, "dtype": "auto",
                                "free_gpu_memory_fraction": self.kv_cache_config.free_gpu_memory_fraction},
        }
        # Absent means TensorRT-LLM's default CUDA graph config; an explicit null turns graphs off there.
        if self.cuda_graph_config is None or self.cuda_graph_config:
            kw["cuda_graph_config"] = copy.deepcopy(self.cuda_graph_config)
        if self.tensor_parallel_size != 1:
            kw["tensor_parallel_size"] = self.tensor_parallel_size
        return kw


# ------------------------------------------------------------------------------------------ YAML

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str) and key in seen:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: key '{key}' is given twice; keep one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | Path) -> DeploymentConfig:
    """Read, validate and resolve the deployment YAML at ``path``."""
    p = Path(path)
    where = str(path)
    if not p.is_file() and p.name == str(path):     # a bare name: a shipped config (l20_bs1 or l20_bs1.yaml)
        shipped = REPO_CONFIG_DIR / (p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml")
        if shipped.is_file():
            p = shipped
    if not p.is_file():
        hint = "" if p.suffix in (".yaml", ".yml") else " (expected a .yaml file)"
        names = ", ".join(sorted(q.stem for q in REPO_CONFIG_DIR.glob("*.yaml")))
        raise ConfigError(f"{where}: no such config file{hint}; shipped configs: {names}")
    try:
        data = yaml.load(p.read_text(), Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: {at}invalid YAML ({problem})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a text file (expected UTF-8 YAML)") from None
    return parse_config(data, where=where, base_dir=p.parent, default_name=p.stem, source=p)


# ------------------------------------------------------------------------------------------ reading

def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, str):
        return f"a string ('{v}')"
    if isinstance(v, (list, dict)):
        return f"a {'list' if isinstance(v, list) else 'mapping'}"
    return f"{type(v).__name__} {v!r}"


class _Section:
    """One mapping of the config: rejects unknown keys on entry, then reads typed values by key."""

    def __init__(self, raw: Any, where: str, path: str):
        self.where, self.path = where, path
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            what = f"'{path}'" if path else "the top level"
            raise ConfigError(f"{where}: {path or 'config'}: expected a mapping at {what}, got {_type_name(raw)}")
        self.raw = raw
        for key in raw:
            if key not in SCHEMA[path]:
                self.fail(str(key), f"unknown key{_suggest(str(key), path)}; allowed here: {', '.join(SCHEMA[path])}")

    def dotted(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, msg: str) -> None:
        raise ConfigError(f"{self.where}: {self.dotted(key)}: {msg}")

    def _given(self, key: str, default: Any) -> bool:
        """Whether ``key`` has a value; absent or null means the default (as in TensorRT-LLM)."""
        if self.raw.get(key) is not None:
            return True
        if default is _REQUIRED:
            self.fail(key, "required; add it to the config")
        return False

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        if not self._given(key, default):
            return default
        v = self.raw[key]
        if isinstance(v, bool) or not isinstance(v, int):  # bool is an int subclass in Python
            self.fail(key, f"expected an integer, got {_type_name(v)}")
        if v < minimum:
            self.fail(key, f"{v} must be >= {minimum}")
        return v

    def boolean(self, key: str, default: bool) -> bool:
        if not self._given(key, default):
            return default
        v = self.raw[key]
        if not isinstance(v, bool):
            self.fail(key, f"expected true or false, got {_type_name(v)}")
        return v

    def number(self, key: str, default: float) -> float:
        if not self._given(key, default):
            return default
        v = self.raw[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(key, f"expected a number, got {_type_name(v)}")
        if not math.isfinite(v):
            self.fail(key, f"{v} is not a finite number")
        return float(v)

    def string(self, key: str, default: Any = _REQUIRED, choices: tuple[str, ...] | None = None) -> Any:
        if not self._given(key, default):
            return default
        v = self.raw[key]
        if not isinstance(v, str) or not v.strip():
            self.fail(key, f"expected a non-empty string, got {_type_name(v)}")
        if choices is not None and v not in choices:
            close = difflib.get_close_matches(v, choices, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self.fail(key, f"'{v}' is not one of {', '.join(choices)}{hint}")
        return v

    def section(self, key: str) -> "_Section":
        return _Section(self.raw.get(key), self.where, self.dotted(key))


def _suggest(key: str, path: str) -> str:
    """' (did you mean X?)' for a misspelt key, or for a key that belongs to another section."""
    close = difflib.get_close_matches(key, SCHEMA[path], n=1)
    if close:
        return f" (did you mean '{close[0]}'?)"
    for section, keys in SCHEMA.items():
        others = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)
        if section != path and others:
            return f" (did you mean '{section + '.' if section else ''}{others[0]}'?)"
    return ""


def _resolve_model_path(model: str, base_dir: Path) -> str:
    """Relative checkpoint / config.json paths are relative to the YAML's directory; names stay names."""
    p = Path(model).expanduser()
    if p.is_absolute():
        return str(p)
    looks_like_path = "/" in model or os.sep in model or model.startswith(".") or model.endswith(".json")
    if looks_like_path or (base_dir / p).exists():
        return str((base_dir / p).resolve())
    return model


# ------------------------------------------------------------------------------------------ parsing

def parse_config(data: Any, where: str = "<config>", base_dir: str | Path | None = None,
                 default_name: str | None = None, source: Path | None = None) -> DeploymentConfig:
    """Validate and resolve a config given as a dict (as read from YAML).

    ``where`` prefixes every error (the file name); relative model paths are resolved against
    ``base_dir`` (default: the current directory); ``default_name`` is used when ``name`` is absent.
    """
    if data is None:
        raise ConfigError(f"{where}: the config is empty; it needs at least model, gpu, max_batch_size and max_seq_len")
    top = _Section(data, where, "")
    kv_s, pre_s, mk_s = top.section("kv_cache_config"), top.section("prefill"), top.section("megakernel")
    quant_s = top.section("quantization")

    name = top.string("name", default_name if default_name is not None else _REQUIRED)
    if not _NAME_RE.match(name):
        top.fail("name", f"'{name}' must be letters, digits, '.', '_' or '-' (it names the engine directory)")
    dtype = top.string("dtype", "bfloat16")
    if dtype not in DTYPE_BYTES:
        top.fail("dtype", f"'{dtype}' is not supported: the megakernel computes in bfloat16 only "
                          f"(use dtype: bfloat16)")
    max_batch_size = top.integer("max_batch_size")
    if max_batch_size > MAX_BATCH:
        top.fail("max_batch_size", f"{max_batch_size} is more than the megakernel decodes per step ({MAX_BATCH}: the "
                                   f"batch rows are the 8 columns of its tensor-core tile); lower max_batch_size to at most {MAX_BATCH}")
    max_seq_len = top.integer("max_seq_len")
    # TensorRT-LLM's default max_input_len is 1024.
    max_input_len = top.integer("max_input_len", min(1024, max_seq_len))
    if max_input_len > max_seq_len:
        top.fail("max_input_len", f"{max_input_len} exceeds max_seq_len {max_seq_len} (a prompt must leave room "
                                  f"to generate; lower max_input_len or raise max_seq_len)")
    max_num_tokens = top.integer("max_num_tokens", max_batch_size * max_input_len)
    tp = top.integer("tensor_parallel_size", 1)
    if tp not in TP_SIZES:
        top.fail("tensor_parallel_size", f"{tp} is not one of {', '.join(map(str, TP_SIZES))} (the GPUs of one host "
                                         f"that share each layer)")
    if max_num_tokens < max_input_len:
        top.fail("max_num_tokens", f"{max_num_tokens} is below max_input_len {max_input_len}: prefill runs a "
                                   f"whole prompt in one pass (raise max_num_tokens to at least {max_input_len})")

    tokens_per_block = kv_s.integer("tokens_per_block", 32)
    if tokens_per_block & (tokens_per_block - 1):
        kv_s.fail("tokens_per_block", f"{tokens_per_block} is not a power of two (use 16, 32 or 64)")
    kv_dtype = kv_s.string("dtype", "bfloat16", choices=KV_CACHE_DTYPES)
    fraction = kv_s.number("free_gpu_memory_fraction", 0.9)
    if not 0.0 < fraction <= 1.0:
        kv_s.fail("free_gpu_memory_fraction", f"{fraction} must be in (0, 1], e.g. 0.9")
    kv_cache = KvCacheConfig(tokens_per_block=tokens_per_block, dtype="bfloat16" if kv_dtype == "auto" else kv_dtype,
                             free_gpu_memory_fraction=fraction)

    cuda_graph_config: dict | None = {}
    if "cuda_graph_config" in top.raw:
        cuda_graph_config = top.raw["cuda_graph_config"]
        if cuda_graph_config is not None and not isinstance(cuda_graph_config, dict):
            top.fail("cuda_graph_config", f"expected a mapping (TensorRT-LLM's CudaGraphConfig) or null, "
                                          f"got {_type_name(cuda_graph_config)}")
        cuda_graph_config = copy.deepcopy(cuda_graph_config)

    prefill = PrefillConfig(backend=pre_s.string("backend", "auto", choices=PREFILL_BACKENDS))

    mode = mk_s.string("mode", "static", choices=MEGAKERNEL_MODES)
    if mode != "static":
        mk_s.fail("mode", f"'{mode}' is not implemented yet; only static is (use mode: static)")
    budget = mk_s.number("search_budget_s", MegakernelConfig.search_budget_s)
    if budget <= 0:
        mk_s.fail("search_budget_s", f"{budget:g} must be > 0 seconds, e.g. 60")
    seed = mk_s.integer("seed", 0, minimum=0)
    output_dir = Path(mk_s.string("output_dir", str(Path("engines") / name)))
    context_len = mk_s.integer("context_len", min(512, max_seq_len))
    if context_len > max_seq_len:
        mk_s.fail("context_len", f"{context_len} exceeds max_seq_len {max_seq_len}; the schedule is optimised for "
                                 f"a context the engine can reach (use at most {max_seq_len})")
    megakernel = MegakernelConfig(output_dir=output_dir, context_len=context_len, mode=mode,
                                  search_budget_s=budget, seed=seed,
                                  max_plan_attempts=mk_s.integer("max_plan_attempts",
                                                                 MegakernelConfig.max_plan_attempts),
                                  allow_spills=mk_s.boolean("allow_spills", False))

    gpu_spec = _resolve_gpu(top.string("gpu"), where)
    model = _resolve_model_path(top.string("model"), Path(base_dir) if base_dir is not None else Path.cwd())
    resolved = _resolve_model(model, where)
    spec = resolved.spec
    try:
        check_kernel_supported(spec)
    except UserError as e:
        raise ConfigError(f"{where}: model: {e}") from None

    _check_tensor_parallel(spec, tp, where)

    if max_seq_len > spec.max_position_embeddings:
        top.fail("max_seq_len", f"{max_seq_len} exceeds the model's max_position_embeddings "
                                f"{spec.max_position_embeddings} (use at most {spec.max_position_embeddings})")
    if spec.sliding_window is not None and spec.sliding_window < max_seq_len:
        top.fail("max_seq_len", f"{max_seq_len} exceeds the model's sliding_window {spec.sliding_window}; sliding-"
                                f"window attention is not implemented (use at most {spec.sliding_window}, with "
                                f"max_input_len below it)")

    scheme = _checkpoint_quantization(model, resolved, where)
    quantization = _quantization(quant_s, scheme, resolved.checkpoint_dir)
    if scheme is None and quantization is not None:
        scheme = QuantScheme.from_section(quantization)
    spec = kernel_spec(spec, scheme)

    cfg = DeploymentConfig(
        name=name, model=model, gpu=gpu_spec.name, dtype=dtype, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len, max_input_len=max_input_len, max_num_tokens=max_num_tokens,
        kv_cache_config=kv_cache, cuda_graph_config=cuda_graph_config, prefill=prefill, megakernel=megakernel,
        model_spec=spec, gpu_spec=gpu_spec, checkpoint_dir=resolved.checkpoint_dir,
        model_source=resolved.source, quantization=quantization, quant_scheme=scheme, tensor_parallel_size=tp,
        source=source)
    _check_memory(cfg, where)
    return cfg


def with_overrides(cfg: DeploymentConfig, changes: dict[str, Any], where: str = "command line") -> DeploymentConfig:
    """``cfg`` with ``changes`` (a nested dict in YAML form, e.g. {"megakernel": {"seed": 3}}) applied and
    the whole result validated again, so an override can never produce a config a file could not."""
    data = cfg.to_dict()
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data, where=where, source=cfg.source)


def _check_tensor_parallel(spec: ModelSpec, tp: int, where: str) -> None:
    """The model splits over ``tp`` GPUs, and each GPU's share meets the megakernel's shape constraints."""
    try:
        check_tensor_parallel(spec, tp)
    except UserError as e:
        raise ConfigError(f"{where}: tensor_parallel_size: {e}") from None
    if tp == 1:
        return
    try:
        check_kernel_supported(rank_spec(spec, tp))
    except UserError as e:
        raise ConfigError(f"{where}: tensor_parallel_size: {tp} leaves each GPU a share the megakernel cannot compute "
                          f"({e}); use a smaller tensor_parallel_size") from None


def kernel_spec(spec: ModelSpec, scheme: QuantScheme | None) -> ModelSpec:
    """The model spec the megakernel is searched and built for: bf16 weights whatever dtype the
    checkpoint stores them in (they are cast as they load), or 4-bit weights in the kernel's layout
    when ``scheme`` is one it streams (else the builder refuses the scheme in one line,
    ``build.check_buildable``; the CPU paths still read it dequantized)."""
    spec = dataclasses.replace(spec, dtype="bfloat16")
    if scheme is None:
        return spec
    try:
        return quantized_spec(spec, scheme)
    except UnsupportedQuantization:
        return spec


def _resolve_gpu(name: str, where: str) -> GpuSpec:
    try:
        return get_gpu(name)
    except UserError as e:  # get_gpu's messages already start with "gpu: "
        raise ConfigError(f"{where}: {e}") from None


def _resolve_model(model: str, where: str):
    from .graph import check_kernel_supported  # the graph package pulls in the task machinery; load late
    try:
        resolved = resolve_model(model)
        check_kernel_supported(resolved.spec)
    except UserError as e:
        msg = str(e)
        raise ConfigError(f"{where}: {msg if msg.startswith('model: ') else 'model: ' + msg}") from None
    return resolved


def _checkpoint_quantization(model: str, resolved, where: str) -> QuantScheme | None:
    """The quantization the model's checkpoint (or config.json file) declares; None when unquantized."""
    from .quant.detect import read_scheme, scheme_from_config
    try:
        if resolved.checkpoint_dir is not None:
            return read_scheme(resolved.checkpoint_dir)
        p = Path(model)
        if p.is_file():
            return scheme_from_config(read_json_object(p, ModelError, "expected an HF config.json"), str(p))
    except UserError as e:
        raise ConfigError(f"{where}: model: {e}") from None
    return None


# quant_algo -> (allowed group sizes, default group size, zero points: allowed values)
_QUANT_ALGO_RULES = {
    "W4A16_GPTQ": ((32, 64, 128), 128, (False, True)),
    "W8A16_GPTQ": ((32, 64, 128), 128, (False, True)),
    "W4A16_AWQ": ((32, 64, 128), 128, (True,)),
    "W4A16": ((PER_CHANNEL,), PER_CHANNEL, (False, True)),
    "W8A16": ((PER_CHANNEL,), PER_CHANNEL, (False, True)),
    "FP8": ((PER_TENSOR,), PER_TENSOR, (False,)),
    "FP8_PER_CHANNEL_PER_TOKEN": ((PER_CHANNEL,), PER_CHANNEL, (False,)),
}


def _quantization(sec: "_Section", scheme: QuantScheme | None, checkpoint_dir: Path | None) -> dict | None:
    """The resolved ``quantization`` section: the checkpoint's when absent, checked against it when given,
    as written for a checkpoint-less (shapes only) model."""
    algo = sec.string("quant_algo", None, choices=QUANT_ALGOS)
    if algo is None:
        given = [k for k in SCHEMA["quantization"] if sec.raw.get(k) is not None]
        if given and scheme is None:
            sec.fail("quant_algo", f"required with {', '.join(given)} (one of {', '.join(QUANT_ALGOS)})")
        if scheme is None:
            return None
        algo = scheme.quant_algo
    sizes, default_gs, zps = _QUANT_ALGO_RULES[algo]
    own = scheme.section() if scheme is not None and scheme.quant_algo == algo else None
    gs = sec.integer("group_size", own["group_size"] if own else default_gs, minimum=-1)
    if gs not in sizes:
        sec.fail("group_size", f"{gs} is not a group size of {algo} (use {' or '.join(map(str, sizes))}; "
                               f"-1: one scale per output channel, 0: one per tensor)")
    zp = sec.raw.get("has_zero_point")
    if zp is None:
        zp = own["has_zero_point"] if own else zps[0]
    if not isinstance(zp, bool):
        sec.fail("has_zero_point", f"expected true or false, got {_type_name(zp)}")
    if zp not in zps:
        sec.fail("has_zero_point", f"{str(zp).lower()} is not possible for {algo}")
    exclude = sec.raw.get("exclude_modules")
    if exclude is None:
        exclude = list(scheme.exclude_modules) if scheme is not None else ["lm_head"]
    if not isinstance(exclude, list) or not all(isinstance(m, str) for m in exclude):
        sec.fail("exclude_modules", f"expected a list of module names, got {_type_name(exclude)}")
    resolved = {"quant_algo": algo, "group_size": gs, "has_zero_point": zp, "exclude_modules": list(exclude)}
    if scheme is None and checkpoint_dir is not None:
        sec.fail("quant_algo", f"{algo} but the checkpoint {checkpoint_dir} holds unquantized weights; quantize it "
                               "first (python -m trtllm_mk quantize) or remove the quantization section")
    if scheme is not None:
        have = scheme.section()
        for key in ("quant_algo", "group_size", "has_zero_point"):
            if resolved[key] != have[key]:
                want = str(have[key]).lower() if isinstance(have[key], bool) else have[key]
                sec.fail(key, f"{resolved[key]!r} disagrees with the checkpoint, which holds {scheme.describe()}; "
                              f"set {key}: {want} or leave it out")
        if sorted(resolved["exclude_modules"]) != sorted(have["exclude_modules"]):
            sec.fail("exclude_modules", f"{resolved['exclude_modules']} disagrees with the checkpoint's unquantized "
                                        f"modules {have['exclude_modules']}; leave it out")
    return resolved


def _check_memory(cfg: DeploymentConfig, where: str) -> None:
    mem = cfg.memory_budget()
    if mem.fits:
        return
    gpu, kv = cfg.gpu_spec, cfg.kv_cache_config
    left = mem.gpu_memory - mem.weights - mem.activations
    need = (f"weights {mem.weights / GB:.2f} GB + activations {mem.activations / GB:.2f} GB leave "
            f"{left / GB:.2f} GB of {gpu.name}'s {gpu.hbm_bytes / GB:.0f} GB, of which the KV cache may take "
            f"{mem.available / GB:.2f} GB (free_gpu_memory_fraction {kv.free_gpu_memory_fraction:g}), but it needs "
            f"{mem.kv_cache / GB:.2f} GB ({cfg.max_batch_size} x {cfg.max_seq_len} tokens)")
    bigger = [g.name for g in CATALOG.values() if g.hbm_bytes > gpu.hbm_bytes and
              memory_budget(cfg.rank_spec, g, max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len,
                            max_num_tokens=cfg.max_num_tokens, tokens_per_block=kv.tokens_per_block,
                            free_gpu_memory_fraction=kv.free_gpu_memory_fraction).fits]
    other_gpu = f"a GPU with more memory ({', '.join(bigger)})" if bigger else "a GPU with more memory"
    more = _fitting_tensor_parallel_size(cfg)
    split = f" (or split it over GPUs: tensor_parallel_size: {more} fits)" if more is not None else ""
    per_gpu = f" per GPU (tensor_parallel_size {cfg.tensor_parallel_size})" if cfg.tensor_parallel_size > 1 else ""
    need += per_gpu
    if not mem.weights_fit:
        raise ConfigError(f"{where}: model: weights {mem.weights / GB:.2f} GB + activations "
                          f"{mem.activations / GB:.2f} GB{per_gpu} exceed {gpu.name}'s {gpu.hbm_bytes / GB:.0f} GB; "
                          f"the weights (and prefill activations) alone do not fit: use {other_gpu} or a smaller "
                          f"model{split}")
    # Whole KV blocks of every sequence that fit in the KV cache's share.
    block_bytes = kv.tokens_per_block * cfg.rank_spec.kv_bytes_per_token()
    blocks_per_seq = mem.available // (cfg.max_batch_size * block_bytes)
    if blocks_per_seq * kv.tokens_per_block < cfg.max_input_len:
        raise ConfigError(f"{where}: max_batch_size: {need}; lower max_batch_size or max_seq_len, or use "
                          f"{other_gpu}{split}")
    raise ConfigError(f"{where}: max_seq_len: {need}; lower max_seq_len to at most "
                      f"{blocks_per_seq * kv.tokens_per_block} (or max_batch_size), or use {other_gpu}{split}")


def _fitting_tensor_parallel_size(cfg: DeploymentConfig) -> int | None:
    """The smallest tensor_parallel_size above the configured one that the model splits into and whose
    per-GPU budget fits on the configured GPU; None if there is none."""
    for tp in TP_SIZES:
        if tp <= cfg.tensor_parallel_size:
            continue
        try:
            _check_tensor_parallel(cfg.model_spec, tp, "")
        except UserError:
            continue
        if dataclasses.replace(cfg, tensor_parallel_size=tp).memory_budget().fits:
            return tp
    return None
