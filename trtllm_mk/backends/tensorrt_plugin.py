"""TensorRT face of the megakernel: load the plugin library and put one decode step into a network.

The library (``libtrtllm_mk_trt_plugin.so``, built by ``trtllm_mk/plugin/CMakeLists.txt``) registers the
IPluginV3 ``TrtllmMkDecodeStep`` (version ``"1"``, namespace ``""``) through its exported
``getCreators``; its only field is ``engine_dir``, a trtllm_mk engine directory. Written against the
TensorRT 10/11 Python API (``get_plugin_registry().load_library``, ``PluginFieldCollection``,
``IPluginCreatorV3One.create_plugin(name, fc, TensorRTPhase.BUILD)``, ``INetworkDefinition.add_plugin_v3``).

    import tensorrt as trt
    from trtllm_mk.backends.tensorrt_plugin import load_plugin_library, add_decode_step
    load_plugin_library("build/trt_plugin/libtrtllm_mk_trt_plugin.so")
    step = add_decode_step(network, "engines/h100_bs1", tokens, pos, kv_pool, block_table, embed,
                           final_norm, lm_head, inv_freq, layers)
    network.mark_output(step.next_tokens); network.mark_output(step.logits)

At run time ``kv_pool`` must be bound to the paged KV cache itself
(``context.set_tensor_address("kv_pool", cache.pool.data_ptr())``): the step appends its K/V there in
place, as TensorRT-LLM's attention plugin does with its pool (trtllm_mk/plugin/trt/README.md says why and
what that requires).

TensorRT cannot be installed in this project's development environment, so this module was written
against TensorRT's public Python sources and never executed; the C++ plugin was compiled against
TensorRT's public headers (see trtllm_mk/plugin/trt/README.md). Without TensorRT every entry point raises
``TensorRTNotInstalled`` with one line saying how to install it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import EngineError, UserError
# the order of mk::LayerWeights and the entries a model family may lack; the plugin's identity
from ..seam import (LAYER_FIELD_NAMES, OPTIONAL_LAYER_FIELDS, TRT_PLUGIN_FIXED_INPUTS, TRT_PLUGIN_NAME,
                    TRT_PLUGIN_NAMESPACE, TRT_PLUGIN_VERSION)

PLUGIN_NAME = TRT_PLUGIN_NAME
PLUGIN_VERSION = TRT_PLUGIN_VERSION
PLUGIN_NAMESPACE = TRT_PLUGIN_NAMESPACE
LIBRARY_NAME = "libtrtllm_mk_trt_plugin.so"
LIBRARY_ENV = "TRTLLM_MK_TRT_PLUGIN"   # the library's path, when not passed explicitly
# Where the build below puts it, relative to the current directory.
DEFAULT_LIBRARY = Path("build") / "trt_plugin" / LIBRARY_NAME
# The plugin's CMake project ships in the package (C++ sources in trtllm_mk/plugin/trt), so it builds
# the same from a source checkout and from an installed wheel.
PLUGIN_SOURCE_DIR = Path(__file__).resolve().parents[1] / "plugin"
BUILD_COMMAND = (f"cmake -S {PLUGIN_SOURCE_DIR} -B build/trt_plugin -DTENSORRT_ROOT=<tensorrt> && "
                 f"cmake --build build/trt_plugin")

INSTALL_HINT = ("install TensorRT 10 or 11 with its Python bindings (pip install tensorrt, which downloads from "
                "NVIDIA's index pypi.nvidia.com, or NVIDIA's tar/deb packages), then build the plugin with "
                f"{BUILD_COMMAND}")


class TensorRTNotInstalled(UserError):
    """``import tensorrt`` failed: the TensorRT integration cannot be used here."""


def import_tensorrt():
    """The ``tensorrt`` module (10.x or newer), or one clear error saying how to get it."""
    try:
        import tensorrt as trt  # noqa: PLC0415 - optional dependency, imported on use
    except ImportError as e:
        raise TensorRTNotInstalled(f"TensorRT is not installed (import tensorrt failed: {e}); {INSTALL_HINT}") from None
    version = getattr(trt, "__version__", "0")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < 10:
        raise TensorRTNotInstalled(f"TensorRT {version} is too old: the plugin is an IPluginV3 (TensorRT 10 or "
                                   f"newer); {INSTALL_HINT}")
    return trt


def find_plugin_library(path: str | os.PathLike | None = None) -> Path:
    """``path``, else $TRTLLM_MK_TRT_PLUGIN, else ./build/trt_plugin/libtrtllm_mk_trt_plugin.so (relative to
    the current directory); must exist."""
    cand = Path(path or os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY).expanduser()
    if not cand.is_file():
        raise EngineError(f"{cand.absolute()}: no TensorRT plugin library there; build it with {BUILD_COMMAND} "
                          f"(then pass the path of {LIBRARY_NAME} or set {LIBRARY_ENV} to it)")
    return cand.resolve()


def get_creator(trt=None):
    """The registered TrtllmMkDecodeStep creator, or an error saying to load the library first."""
    trt = trt or import_tensorrt()
    creator = trt.get_plugin_registry().get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE)
    if creator is None:
        raise EngineError(f"TensorRT plugin {PLUGIN_NAME} version {PLUGIN_VERSION} is not registered: call "
                          f"load_plugin_library() with the path of {LIBRARY_NAME} first")
    return creator


def load_plugin_library(path: str | os.PathLike | None = None):
    """Load the plugin library into TensorRT's plugin registry; returns the registry's library handle.

    ``IPluginRegistry.load_library`` calls the library's ``setLoggerFinder`` and ``getCreators``, so
    no libnvinfer is linked into it; loading the same path twice is harmless (the first handle wins).
    """
    trt = import_tensorrt()
    lib = find_plugin_library(path)
    registry = trt.get_plugin_registry()
    handle = registry.load_library(str(lib))
    if handle is None:
        raise EngineError(f"{lib}: TensorRT could not load the plugin library (its log says why; a library built "
                          f"for another CUDA or TensorRT major version is the usual cause)")
    get_creator(trt)  # the library must have registered our creator
    return handle


def read_kernel_json(engine_dir: str | os.PathLike) -> dict:
    """kernel.json of an engine directory (its schema: trtllm_mk/plugin/trt/kernel_json.h)."""
    path = Path(engine_dir) / "kernel.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: missing; {engine_dir} is not an engine directory (build one with "
                          f"python build_scripts/build_engine.py --config <config.yaml>)") from None
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: corrupted JSON ({e.msg}); rebuild the engine") from None


def check_bf16_engine(kernel: dict, engine_dir: str | os.PathLike) -> None:
    """The plugin binds bf16 layer weights on one GPU only: an engine whose kernel streams 4-bit weights
    (packed codes and scale words, ``mk::LayerScales``) or runs tensor-parallel is refused in one line."""
    bits = kernel.get("weight_bits", 16)
    if bits != 16:
        raise UserError(f"{engine_dir}: the engine streams {bits}-bit weights (W{bits}A16 group "
                        f"{kernel.get('weight_group')}); the TensorRT plugin binds bf16 weights only, so quantized "
                        "engines run through the PyTorch runtime (python -m trtllm_mk run / serve)")
    if kernel.get("experts"):   # the plugin's inputs are a dense layer's weights
        raise UserError(f"{engine_dir}: a mixture-of-experts engine ({kernel['experts']} experts); the TensorRT plugin "
                        "binds dense layers only, so it runs through the PyTorch runtime (python -m trtllm_mk run)")
    tp = kernel.get("tensor_parallel", 1)
    if tp != 1:   # the plugin binds one GPU's buffers and no peers
        raise UserError(f"{engine_dir}: a tensor-parallel engine ({tp} GPUs); the TensorRT plugin runs one GPU's "
                        f"kernel, so it runs through the PyTorch runtime (torchrun --nproc-per-node {tp} -m "
                        "trtllm_mk run)")


@dataclass
class DecodeStep:
    """What ``add_decode_step`` put into the network. Keep it alive until the engine is built: the
    plugin object created for the build phase is owned by the caller (TensorRT's rule)."""
    layer: Any                # IPluginV3Layer
    plugin: Any               # IPluginV3 (build phase)
    next_tokens: Any          # ITensor int32 [B]
    logits: Any               # ITensor float32 [B, V]
    placeholder: Any = None   # ITensor bf16 [1] used for absent optional weights, if any


def _placeholder(trt, network):
    """A 1-element bf16 tensor: what the plugin takes for a weight the model does not have (it passes a
    null pointer to the kernel). A float32 constant cast to bf16, since numpy has no bfloat16."""
    const = network.add_constant((1,), trt.Weights(np.zeros(1, dtype=np.float32)))
    const.name = "trtllm_mk_absent_weight_f32"
    cast = network.add_cast(const.get_output(0), trt.DataType.BF16)
    cast.name = "trtllm_mk_absent_weight"
    return cast.get_output(0)


def _layer_tensors(layers: Sequence[Mapping[str, Any] | Sequence[Any]], num_layers: int,
                   absent) -> list:
    if len(layers) != num_layers:
        raise UserError(f"{len(layers)} layers of weights given but the engine has {num_layers}")
    flat = []
    for i, layer in enumerate(layers):
        if isinstance(layer, Mapping):
            unknown = set(layer) - set(LAYER_FIELD_NAMES)
            if unknown:
                raise UserError(f"layer {i}: unknown weight names {sorted(unknown)}; expected {list(LAYER_FIELD_NAMES)}")
            values = [layer.get(name) for name in LAYER_FIELD_NAMES]
        else:
            values = list(layer)
            if len(values) != len(LAYER_FIELD_NAMES):
                raise UserError(f"layer {i}: {len(values)} tensors given, expected {len(LAYER_FIELD_NAMES)} in the "
                                f"order {list(LAYER_FIELD_NAMES)} (None for absent optional ones)")
        for name, t in zip(LAYER_FIELD_NAMES, values):
            if t is None:
                if name not in OPTIONAL_LAYER_FIELDS:
                    raise UserError(f"layer {i}: weight {name} is required")
                t = absent()
            flat.append(t)
    return flat


def add_decode_step(network, engine_dir: str | os.PathLike, tokens, pos, kv_pool, block_table, embed, final_norm,
                    lm_head, inv_freq, layers: Sequence[Mapping[str, Any] | Sequence[Any]],
                    name: str = "trtllm_mk_decode_step") -> DecodeStep:
    """Insert one megakernel decode step into ``network`` (an ``INetworkDefinition``).

    Tensors (``ITensor``): tokens int32 [B]; pos int32 [B]; kv_pool bf16 [L, num_blocks, 2, NKV, TPB, D]
    (a network input, bound to the KV cache at run time); block_table int32 [B, max_blocks]; embed /
    lm_head bf16 [V, H]; final_norm bf16 [H]; inv_freq float32 [D/2]. ``layers``: per layer either a
    mapping from ``LAYER_FIELD_NAMES`` to tensors (absent optional ones may be left out) or a sequence
    of 14 tensors in that order (None for absent ones). B, V and the dimensions must be those of the
    engine's kernel.json; the plugin checks them when the network is built and logs what differs.
    """
    trt = import_tensorrt()
    engine_dir = Path(engine_dir).resolve()
    kernel = read_kernel_json(engine_dir)
    if not (engine_dir / "megakernel.cubin").is_file():
        raise EngineError(f"{engine_dir}: missing megakernel.cubin; rebuild the engine")
    creator = get_creator(trt)

    holder: dict[str, Any] = {}

    def absent():
        if "t" not in holder:
            holder["t"] = _placeholder(trt, network)
        return holder["t"]

    check_bf16_engine(kernel, engine_dir)
    try:
        num_layers = int(kernel["dims"]["L"])
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"{engine_dir / 'kernel.json'}: no dims.L; rebuild the engine") from None
    layer_inputs = _layer_tensors(layers, num_layers, absent)
    # The path travels into the serialized engine; a NUL terminator makes it a C string for any reader.
    path_bytes = np.frombuffer(str(engine_dir).encode() + b"\0", dtype=np.int8)
    fc = trt.PluginFieldCollection([trt.PluginField("engine_dir", path_bytes, trt.PluginFieldType.CHAR)])
    plugin = creator.create_plugin(name, fc, trt.TensorRTPhase.BUILD)
    if plugin is None:
        raise EngineError(f"TensorRT plugin {PLUGIN_NAME} refused engine dir {engine_dir} (TensorRT's log has the "
                          f"plugin's reason)")
    fixed = dict(tokens=tokens, pos=pos, kv_pool=kv_pool, block_table=block_table, embed=embed,
                 final_norm=final_norm, lm_head=lm_head, inv_freq=inv_freq)
    inputs = [fixed[n] for n in TRT_PLUGIN_FIXED_INPUTS] + layer_inputs   # the plugin's input order
    layer = network.add_plugin_v3(inputs, [], plugin)
    if layer is None:
        raise EngineError(f"INetworkDefinition.add_plugin_v3 refused {PLUGIN_NAME} (TensorRT's log says why)")
    layer.name = name
    return DecodeStep(layer=layer, plugin=plugin, next_tokens=layer.get_output(0), logits=layer.get_output(1),
                      placeholder=holder.get("t"))
