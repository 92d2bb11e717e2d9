"""The one description of the interface between the Python host and the generated CUDA kernel.

Codegen emits the C++ declarations from it (``emit_cuda``: ``enum Kind``, ``struct LayerWeights``,
``struct Params``, ``struct TaskArgs``, the trace word names and a ``static_assert`` per Params field
offset, so nvcc checks the layout computed here), the Python runtime packs ``Params`` from it
(``pack_params``), kernel.json records the layout (``params_layout_json``) so the TensorRT plugin
packs from offsets, and the TensorRT backend takes the layer weight order from it. Importable without
torch.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# C type -> (size, alignment, struct format char). Every pointer is 8 bytes on the 64-bit hosts
# and devices the kernel runs on.
_SCALARS = {"int": (4, 4, "i"), "uint32_t": (4, 4, "I"), "float": (4, 4, "f"), "int64_t": (8, 8, "q"),
            "uint64_t": (8, 8, "Q")}
_POINTER = (8, 8, "Q")

WEIGHT, BUFFER, SCALAR = "weight", "buffer", "scalar"   # Params field roles


def ctype_info(ctype: str) -> tuple[int, int, str]:
    """(size, alignment, struct format char) of a C type of the seam."""
    return _POINTER if ctype.endswith("*") else _SCALARS[ctype]


@dataclass(frozen=True)
class ParamField:
    name: str
    ctype: str
    role: str   # WEIGHT: model tensor; BUFFER: engine-owned device memory; SCALAR: a value
    doc: str


@dataclass(frozen=True)
class LayerWeight:
    field: str       # mk::LayerWeights member
    hf_suffix: str   # tensor name after "model.layers.{i}."
    optional: bool   # absent in some model families (null pointer then)


@dataclass(frozen=True)
class TaskArg:
    name: str
    count: str = ""   # array extent (a cfg constant) or "" for a scalar
    doc: str = ""


LAYER_WEIGHTS = (
    LayerWeight("q", "self_attn.q_proj.weight", False),
    LayerWeight("k", "self_attn.k_proj.weight", False),
    LayerWeight("v", "self_attn.v_proj.weight", False),
    LayerWeight("o", "self_attn.o_proj.weight", False),
    LayerWeight("gate", "mlp.gate_proj.weight", False),
    LayerWeight("up", "mlp.up_proj.weight", False),
    LayerWeight("down", "mlp.down_proj.weight", False),
    LayerWeight("ln1", "input_layernorm.weight", False),
    LayerWeight("ln2", "post_attention_layernorm.weight", False),
    LayerWeight("q_norm", "self_attn.q_norm.weight", True),    # qwen3 QK-norm
    LayerWeight("k_norm", "self_attn.k_norm.weight", True),
    LayerWeight("q_bias", "self_attn.q_proj.bias", True),      # qwen2 q/k/v bias
    LayerWeight("k_bias", "self_attn.k_proj.bias", True),
    LayerWeight("v_bias", "self_attn.v_proj.bias", True),
)
LAYER_FIELD_NAMES = tuple(w.field for w in LAYER_WEIGHTS)

# mk::LayerScales: the scale words of one layer's quantized linear weights (trtllm_mk/quant/kernel_layout.py),
# bound under the weight's name with this suffix; all null in a bf16 kernel.
SCALE_SUFFIX = "_sz"
LAYER_SCALES = tuple(LayerWeight(w.field, w.hf_suffix + SCALE_SUFFIX, False)
                     for w in LAYER_WEIGHTS if w.field in ("q", "k", "v", "o", "gate", "up", "down"))
LAYER_SCALE_NAMES = tuple(w.field for w in LAYER_SCALES)
OPTIONAL_LAYER_FIELDS = frozenset(w.field for w in LAYER_WEIGHTS if w.optional)

PARAMS = (
    ParamField("layers", "const LayerWeights*", WEIGHT, "[L], device array"),
    ParamField("embed", "const bf16*", WEIGHT, "[V, H]"),
    ParamField("final_norm", "const bf16*", WEIGHT, "[H]"),
    ParamField("lm_head", "const bf16*", WEIGHT, "[V, H] (the embedding when tied)"),
    ParamField("inv_freq", "const float*", WEIGHT, "[D/2] RoPE inverse frequencies (llama3 scaling applied on the host)"),
    ParamField("x", "long long*", BUFFER, "[B, H] residual stream, fixed point (trtllm_mk/residual.py)"),
    ParamField("qkv", "uint64_t*", BUFFER, "[B, QKVR] grouped q/k/v projection, each fp32 value tagged (mk::st_tagged)"),
    ParamField("part_o", "float*", BUFFER, "[B, NKV, S, G, D] attention partials"),
    ParamField("part_ml", "float*", BUFFER, "[B, NKV, S, G, 2] (max, sum of exp)"),
    ParamField("attn_out", "float*", BUFFER, "[B, NH*D]"),
    ParamField("act", "uint32_t*", BUFFER, "[B, I] silu(gate) * up, each a bf16 under a 16-bit tag (mk::st_tagged_bf16)"),
    ParamField("logits", "float*", BUFFER, "[B, V]"),
    ParamField("lm_val", "float*", BUFFER, "[B, N_LM_TILES]"),
    ParamField("lm_idx", "int*", BUFFER, "[B, N_LM_TILES]"),
    ParamField("tokens", "int*", BUFFER, "[B] in: this step's token; out: the next token"),
    ParamField("pos", "int*", BUFFER, "[B] position of this step's token; advanced by the step"),
    ParamField("history", "int*", BUFFER, "[B, HISTORY_LEN] history[b, pos+1] = generated token"),
    ParamField("kv_pool", "bf16*", BUFFER, "[L, num_blocks, 2, NKV, TPB, D]"),
    ParamField("block_table", "const int*", BUFFER, "[B, block_table_stride]"),
    ParamField("counters", "uint32_t*", BUFFER, "event counters (monotonic)"),
    ParamField("control", "uint32_t*", BUFFER, "[0] step (monotonic, advanced by the step's ARGMAX), [1..3] unused"),
    ParamField("error", "ErrorInfo*", BUFFER, "first device-side diagnostic (pinned host memory)"),
    ParamField("num_blocks", "int64_t", SCALAR, "blocks per layer in kv_pool"),
    ParamField("block_table_stride", "int64_t", SCALAR, "int32 entries per block-table row"),
    ParamField("trace", "uint64_t*", BUFFER, "optional per-task timeline (null: off); words in TRACE_WORD_NAMES"),
    ParamField("sampling", "const SamplingSlot*", BUFFER, "[B] how each row chooses its token (all zero: greedy)"),
    ParamField("lm_lse", "float*", BUFFER, "[B, N_LM_TILES, 4] per tile (max, sum of exp) of l and of l / T"),
    ParamField("logprobs", "float*", BUFFER, "[B, 1 + MAX_TOP_LOGPROBS] chosen token's log-probability, top ones'"),
    ParamField("top_ids", "int*", BUFFER, "[B, MAX_TOP_LOGPROBS] the most likely tokens (logprobs > 1)"),
    ParamField("cand_hist", "uint32_t*", BUFFER, "[B, CAND_HIST_BINS] logits per key bin (zero between steps)"),
    ParamField("layer_scales", "const LayerScales*", WEIGHT, "[L] quantized weights' scale words (null: bf16 weights)"),
    ParamField("peers", "const PeerBuffers*", BUFFER, "[TP] every rank's cross-rank buffers, this rank's too (null: TP = 1)"),
    ParamField("rank", "int64_t", SCALAR, "this rank of TP (0 without tensor parallelism)"),
    ParamField("routers", "const bf16* const*", WEIGHT, "[L] sparse layers' router weights [E, H] (null: dense)"),
    ParamField("experts", "const ExpertWeights*", WEIGHT, "[L, E] the experts' weights (null: dense)"),
    ParamField("router_logits", "float*", BUFFER, "[B, E] (mixture of experts)"),
    ParamField("moe_slot", "int*", BUFFER, "[NSLOT] each expert slot's expert, -1: idle (kinds/route.py)"),
    ParamField("moe_w", "float*", BUFFER, "[NSLOT, B] the slot's routing weight in each row (0: not selected)"),
    ParamField("moe_act", "float*", BUFFER, "[NSLOT, B, I] silu(gate) * up of the slot's expert"),
    ParamField("moe_xn", "float*", BUFFER, "[B, H] the sparse layer's normed rows (ROUTER), the experts' input"),
    ParamField("router_acc", "long long*", BUFFER,
               "[L, B, E, ROUTER_ACC_STRIDE] the router logits in fixed point (word 0), summed along the attention chain"),
    ParamField("expert_sum", "long long*", BUFFER,
               "[L + 1, B, H] row l + 1: layer l's experts' outputs in fixed point, beside x (kinds/router.py)"),
    ParamField("router_o", "const bf16* const*", WEIGHT,
               "[L] under TilePlan.expert_fused: the router through the o-projection [E, QD] (kinds/router.py; null otherwise)"),
)

# mk::ExpertWeights: one expert's matrices, HF layouts ([out, in] row-major), read in place.
EXPERT_FIELDS = (("gate", "[I, H]"), ("up", "[I, H]"), ("down", "[H, I]; [I, H] under TilePlan.expert_fused"))
EXPERT_FIELD_NAMES = tuple(n for n, _ in EXPERT_FIELDS)

# mk::PeerBuffers: the buffers of one tensor-parallel rank that the other ranks write into
# (graph/builder.py, tensor parallelism): device pointers valid on every rank's GPU (peer-mapped
# or symmetric memory), each the same buffer as the rank's own Params field of that name.
PEER_FIELDS = (
    ("x", "long long*", "the residual stream: OPROJ / DOWN add, EMBED writes"),
    ("counters", "uint32_t*", "event counters: cross-rank events are signalled on every rank"),
    ("lm_val", "float*", "[B, TP * N_LM_TILES] LM-head tile maxima of every rank"),
    ("lm_idx", "int*", "[B, TP * N_LM_TILES] their global token ids"),
)
PEER_FIELD_NAMES = tuple(n for n, _, _ in PEER_FIELDS)

TASK_ARGS = (
    TaskArg("layer"), TaskArg("r0"), TaskArg("r1"), TaskArg("k0"), TaskArg("k1"), TaskArg("group"), TaskArg("split"),
    TaskArg("tile"),
    TaskArg("stage", doc="GEMV kinds: 1 = stage the activation, 0 = reuse the previous task's (same input)"),
    TaskArg("nw"), TaskArg("w", "cfg::MAX_REFS", "event references to wait on (event_ref_word)"),
    TaskArg("ns"), TaskArg("s", "cfg::MAX_REFS", "event references to signal (event_ref_word)"),
    TaskArg("nss", doc="the first nss of s are published once the task has staged its input (Task.staged_signals)"),
)

# An event reference in TaskArgs: the flat counter index of the task's row in layer 0 (low bits)
# and the counters between one layer's row and the next (high bits; 0 outside the layer program).
# The device adds layer x stride itself, so a layer loop's call sites pass constants and only the
# layer index stays live across the calls (affine indices would each keep a register, and spill).
EVENT_INDEX_BITS = 20


def event_ref_word(index: int, layer_stride: int) -> int:
    """The TaskArgs word of an event reference (mk::event_counter reads it)."""
    if not 0 <= index < 1 << EVENT_INDEX_BITS or not 0 <= layer_stride < 1 << (31 - EVENT_INDEX_BITS):
        raise ValueError(f"event reference (counter {index}, layer stride {layer_stride}) does not fit a "
                         f"TaskArgs word ({EVENT_INDEX_BITS} + {31 - EVENT_INDEX_BITS} bits)")
    return index | layer_stride << EVENT_INDEX_BITS

# Per SM and task of a traced step, one 64-bit word each (globaltimer ns, or ns durations). After the
# TRACE_TASKS x TRACE_WORDS words of every SM, one row of TRACE_SM_WORDS per SM holds
# [loader ns blocked on a full ring, loader done, consumers done, 0]. Read by runtime/trace.py.
TRACE_WORD_NAMES = (
    "start",           # consumer thread 0: the task starts
    "waited",          # its event waits are satisfied
    "staged",          # its activation is staged
    "signalled",       # it handed its signals over (or finished)
    "full_wait_ns",    # ns it waited for ring slots to fill
    "loader_start",    # loader lane 0 reached the task
    "loader_issued",   # loader issued the task's last copy
    "loader_wait_ns",  # ns of that span the loader waited for a free slot
    "computed",        # consumer thread 0: reduction done (before the output stores)
    "handed",          # about to hand the task's events to the signaller warp
    "published",       # the signaller published them (0: the task has none)
)
TRACE_WORDS = len(TRACE_WORD_NAMES)
TRACE_SM_WORD_NAMES = ("loader_blocked_ns", "loader_done", "consumers_done", "unused")
TRACE_SM_WORDS = len(TRACE_SM_WORD_NAMES)

# trtllm_mk/sampling.py: the candidate set top-k / top-p select from, and the most top log-probabilities
CANDIDATES = 256
MAX_TOP_LOGPROBS = 5
CAND_HIST_BINS = 4096   # bins of the candidate search's first level (device/mk_sampling.cuh)
# int64 words from one of router_acc's accumulators to the next: one a 128-byte line. Every OPROJ task
# adds into every accumulator of its layer (kinds/router.py); packed, their atomics would queue at the
# few L2 slices that hold those lines.
ROUTER_ACC_STRIDE = 16

# mk::SamplingSlot: how a batch row chooses its token (trtllm_mk/sampling.py; device/mk_sampling.cuh).
# All zero is greedy without log-probabilities, so a zero-filled buffer gives the unsampled kernel.
SAMPLING_FIELDS = (
    ("temperature", "float", "0: greedy"),
    ("top_k", "int", "0: off"),
    ("top_p", "float", "off unless 0 < top_p < 1"),
    ("seed_lo", "uint32_t", "the 64-bit seed's low half"),
    ("seed_hi", "uint32_t", "and its high half"),
    ("logprobs", "int", "0: none; 1: the chosen token's log-probability; n: also the n - 1 most likely"),
    ("pad0", "int", ""),
    ("pad1", "int", ""),
)
SAMPLING_SLOT_BYTES = sum(ctype_info(t)[0] for _, t, _ in SAMPLING_FIELDS)


def pack_sampling_slot(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                       logprobs: int | None = None) -> bytes:
    """The bytes of one mk::SamplingSlot (``logprobs`` as in trtllm_mk.sampling.SamplingParams)."""
    seed &= (1 << 64) - 1
    values = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed_lo=seed & 0xFFFFFFFF, seed_hi=seed >> 32,
                  logprobs=0 if logprobs is None else logprobs + 1, pad0=0, pad1=0)
    return struct.pack("<" + "".join(ctype_info(t)[2] for _, t, _ in SAMPLING_FIELDS),
                       *(values[n] for n, _, _ in SAMPLING_FIELDS))


# mk::ErrorInfo: the first fault of a step, 32-bit words in pinned host memory that the host reads
# after the step (also after a trap killed the context). ``code`` says which fault; the other words'
# meaning depends on it.
ERROR_FIELDS = (
    ("code", "ERROR_CODES; 0: none"),
    ("sm", "the SM that recorded it"),
    ("event_index", "WAIT_TIMEOUT: flat counter index"),
    ("target", "WAIT_TIMEOUT: the count waited for"),
    ("seen", "WAIT_TIMEOUT: the count seen last"),
    ("layer", "WAIT_TIMEOUT: the waiting task's layer; NONFINITE_LOGITS: the batch row"),
    ("task", "WAIT_TIMEOUT: the task's number on its SM; NONFINITE_LOGITS: the step"),
    ("pad", ""),
)
ERROR_WORDS = len(ERROR_FIELDS)
ERROR_CODES = {
    "WAIT_TIMEOUT": 1,        # an event wait went unsatisfied too long (the waiter traps)
    "NONFINITE_LOGITS": 2,    # a batch row's logits are all NaN or -inf (its token is set to 0)
}


def error_word(name: str) -> int:
    """Index of an ErrorInfo field."""
    return [f for f, _ in ERROR_FIELDS].index(name)


def params_layout() -> tuple[list[tuple[ParamField, int, int]], int]:
    """([(field, offset, size)], sizeof(Params)) with natural alignment."""
    out, off, align_max = [], 0, 1
    for f in PARAMS:
        size, align, _ = ctype_info(f.ctype)
        off = -(-off // align) * align
        out.append((f, off, size))
        off += size
        align_max = max(align_max, align)
    return out, -(-off // align_max) * align_max


def pack_params(values: dict[str, int]) -> bytes:
    """The bytes of mk::Params from {field name: value} (pointers as integers; 0 for null)."""
    missing = [f.name for f in PARAMS if f.name not in values]
    extra = sorted(set(values) - {f.name for f in PARAMS})
    if missing or extra:
        raise ValueError(f"Params: missing {missing}, unknown {extra}")
    layout, size = params_layout()
    buf = bytearray(size)
    for f, off, _ in layout:
        struct.pack_into("<" + ctype_info(f.ctype)[2], buf, off, values[f.name])
    return bytes(buf)


def params_layout_json() -> dict:
    """The Params layout for kernel.json: what a host without this package packs from."""
    layout, size = params_layout()
    return {"size": size,
            "fields": [{"name": f.name, "ctype": f.ctype, "role": f.role, "offset": off, "size": n}
                       for f, off, n in layout],
            "layer_fields": list(LAYER_FIELD_NAMES), "layer_scale_fields": list(LAYER_SCALE_NAMES),
            "error_fields": [f for f, _ in ERROR_FIELDS], "error_codes": dict(ERROR_CODES),
            "sampling_slot_bytes": SAMPLING_SLOT_BYTES, "max_top_logprobs": MAX_TOP_LOGPROBS,
            "cand_hist_bins": CAND_HIST_BINS,
            "peer_fields": list(PEER_FIELD_NAMES), "expert_fields": list(EXPERT_FIELD_NAMES)}


def _kind_enum() -> str:
    from .graph import Kind
    return "enum Kind { " + ", ".join(f"{k.name} = {int(k)}" for k in Kind) + " };"


def _loader_waits() -> str:
    """Per kind, whether its loader waits for the task's first event before it streams (the kinds'
    LOADER_WAITS: weights an event decides, mk_gemv.cuh gemv_load)."""
    from .graph import Kind
    flags = ", ".join("true" if getattr(k.module, "LOADER_WAITS", False) else "false" for k in Kind)
    return f"constexpr bool LOADER_WAITS[] = {{{flags}}};"


def emit_cuda_preamble() -> str:
    """What the shared device basics (mk_common.cuh) need first: ErrorInfo and its codes."""
    lines = ["namespace mk {", "", "// The first fault of a step (trtllm_mk/seam.py ERROR_FIELDS).", "struct ErrorInfo {"]
    lines += [f"  uint32_t {f};" + (f"  // {doc}" if doc else "") for f, doc in ERROR_FIELDS]
    lines += ["};", "enum ErrorCode : uint32_t { " + ", ".join(f"ERR_{k} = {v}" for k, v in ERROR_CODES.items()) + " };",
              "", "}  // namespace mk"]
    return "\n".join(lines) + "\n"


def emit_cuda() -> str:
    """The interface declarations, in namespace mk (after mk_common.cuh, before mk_params.cuh)."""
    lines = ["namespace mk {", "", "// Task kinds (trtllm_mk.graph.Kind).", _kind_enum(),
             "// Kinds whose loader waits for the routing before it streams (the kinds' LOADER_WAITS).",
             _loader_waits(), "",
             "// Device pointers of one layer's weights, HF layouts ([out, in] row-major), read in place.",
             "struct LayerWeights {"]
    lines += [f"  const bf16* {w.field};  // {w.hf_suffix}{' (optional: null when absent)' if w.optional else ''}"
              for w in LAYER_WEIGHTS]
    lines += ["};", "", "// Scale words of one layer's 4-bit weights (trtllm_mk/quant/kernel_layout.py), [out/16][in/QGROUP][16].",
              "struct LayerScales {"]
    lines += [f"  const uint32_t* {w.field};  // {w.hf_suffix}" for w in LAYER_SCALES]
    lines += ["};", "", "// How a batch row chooses its token (trtllm_mk/sampling.py).", "struct SamplingSlot {"]
    lines += [f"  {t} {n};" + (f"  // {doc}" if doc else "") for n, t, doc in SAMPLING_FIELDS]
    lines += ["};", f"static_assert(sizeof(SamplingSlot) == {SAMPLING_SLOT_BYTES}, \"SamplingSlot layout (trtllm_mk/seam.py)\");"]
    lines += [f"constexpr int CANDIDATES = {CANDIDATES};", f"constexpr int MAX_TOP_LOGPROBS = {MAX_TOP_LOGPROBS};",
              f"constexpr int CAND_HIST_BINS = {CAND_HIST_BINS};",
              f"constexpr int ROUTER_ACC_STRIDE = {ROUTER_ACC_STRIDE};   // router_acc: words between accumulators"]
    lines += ["", "// One expert's weights (mixture of experts).", "struct ExpertWeights {"]
    lines += [f"  const bf16* {n};  // {doc}" for n, doc in EXPERT_FIELDS]
    lines += ["};"]
    lines += ["", "// One tensor-parallel rank's buffers that the other ranks write into.", "struct PeerBuffers {"]
    lines += [f"  {t} {n};  // {doc}" for n, t, doc in PEER_FIELDS]
    lines += ["};"]
    lines += ["", "// Kernel parameters, passed by value as a __grid_constant__.", "struct Params {"]
    lines += [f"  {f.ctype} {f.name};  // {f.doc}" for f in PARAMS]
    lines += ["};"]
    layout, size = params_layout()
    lines.append(f"static_assert(sizeof(Params) == {size}, \"Params layout (trtllm_mk/seam.py)\");")
    lines += [f"static_assert(__builtin_offsetof(Params, {f.name}) == {off}, \"Params layout\");" for f, off, _ in layout]
    lines += ["", f"constexpr int TRACE_WORDS = {TRACE_WORDS};  // per traced task",
              "enum TraceWord { " + ", ".join(f"TW_{n.upper()} = {i}" for i, n in enumerate(TRACE_WORD_NAMES)) + " };",
              f"constexpr int TRACE_SM_WORDS = {TRACE_SM_WORDS};  // per SM, after every SM's task rows",
              "enum TraceSmWord { " + ", ".join(f"TS_{n.upper()} = {i}" for i, n in enumerate(TRACE_SM_WORD_NAMES)) + " };",
              "",
              "// One task's arguments (codegen emits an initializer per task call).", "struct TaskArgs {"]
    for a in TASK_ARGS:
        decl = f"  int {a.name}{f'[{a.count}]' if a.count else ''};"
        lines.append(decl + (f"  // {a.doc}" if a.doc else ""))
    mask = (1 << EVENT_INDEX_BITS) - 1
    lines += ["};", "", "// The flat counter index of event reference ``ref`` (a TaskArgs w/s word) in ``layer``.",
              "__device__ __forceinline__ constexpr int event_counter(int ref, int layer) {",
              f"  return (ref & {mask:#x}) + layer * (ref >> {EVENT_INDEX_BITS});", "}", "", "}  // namespace mk"]
    return "\n".join(lines) + "\n"


def task_args_init(values: dict[str, object]) -> str:
    """An mk::TaskArgs initializer from {argument: C expression or list of them}, in TASK_ARGS order."""
    parts = []
    for a in TASK_ARGS:
        v = values[a.name]
        parts.append("{" + ", ".join(map(str, v)) + "}" if a.count else str(v))
    return "mk::TaskArgs{" + ", ".join(parts) + "}"


# ------------------------------------------------------------------------ the TensorRT plugin's side

# kernel.json "dims": the model dimensions a host without this package needs (the TensorRT plugin checks
# its inputs and sizes its buffers by them): (key, trtllm_mk.graph.Dims attribute, meaning).
KERNEL_DIMS = (
    ("L", "layers", "decoder layers"),
    ("H", "hidden", "hidden size"),
    ("I", "intermediate", "MLP width"),
    ("V", "vocab", "vocabulary size"),
    ("NH", "heads", "query heads"),
    ("NKV", "kv_heads", "KV heads"),
    ("D", "head_dim", "head dimension"),
    ("G", "group", "query heads per KV head"),
    ("QKVR", "qkv_rows", "QKV projection rows: NKV * (G + 2) * D"),
)
KERNEL_DIM_KEYS = tuple(k for k, _, _ in KERNEL_DIMS)


def kernel_dims_json(dims) -> dict[str, int]:
    """kernel.json's "dims" from a step graph's dimensions (trtllm_mk.graph.Dims)."""
    return {key: int(getattr(dims, attr)) for key, attr, _ in KERNEL_DIMS}


# Each mk::LayerWeights tensor's shape in HF layout ([out, in] for linears): per axis, the KERNEL_DIMS
# keys whose product it is.
LAYER_WEIGHT_SHAPES = {
    "q": (("NH", "D"), ("H",)), "k": (("NKV", "D"), ("H",)), "v": (("NKV", "D"), ("H",)),
    "o": (("H",), ("NH", "D")), "gate": (("I",), ("H",)), "up": (("I",), ("H",)), "down": (("H",), ("I",)),
    "ln1": (("H",),), "ln2": (("H",),), "q_norm": (("D",),), "k_norm": (("D",),),
    "q_bias": (("NH", "D"),), "k_bias": (("NKV", "D"),), "v_bias": (("NKV", "D"),),
}


def layer_weight_shape(field: str, dims: dict[str, int]) -> tuple[int, ...]:
    """The shape of layer weight ``field`` for kernel.json ``dims``."""
    out = []
    for axis in LAYER_WEIGHT_SHAPES[field]:
        n = 1
        for key in axis:
            n *= dims[key]
        out.append(n)
    return tuple(out)


# The TensorRT plugin's interface (trtllm_mk/plugin/trt, trtllm_mk/backends/tensorrt_plugin.py): its
# identity in TensorRT's plugin registry, the inputs before the layers' weights (then per layer the
# LAYER_WEIGHTS in order) and its outputs.
TRT_PLUGIN_NAME = "TrtllmMkDecodeStep"
TRT_PLUGIN_VERSION = "1"
TRT_PLUGIN_NAMESPACE = ""
TRT_PLUGIN_FIXED_INPUTS = ("tokens", "pos", "kv_pool", "block_table", "embed", "final_norm", "lm_head", "inv_freq")
TRT_PLUGIN_OUTPUTS = ("next_tokens", "logits")

# The C++ header the plugin's build generates from this file (emit_plugin_header): the CMake build
# (trtllm_mk/plugin/CMakeLists.txt) runs ``python -I trtllm_mk/seam.py --plugin-header <out>``, which
# needs nothing but the standard library (``python -m trtllm_mk.seam`` does the same).
PLUGIN_HEADER_NAME = "seam_generated.h"
PLUGIN_HEADER_NAMESPACE = "trtllm_mk_seam"


def _c_str(s: str) -> str:
    if not s.isascii() or not s.isprintable() or '"' in s or "\\" in s:
        raise ValueError(f"{s!r} cannot be a plain C string literal")
    return f'"{s}"'


def _c_ident(s: str) -> str:
    if not (s.isascii() and s.isidentifier()):
        raise ValueError(f"{s!r} is not a C identifier")
    return s


def _camel(name: str) -> str:
    return "k" + "".join(p[:1].upper() + p[1:] for p in name.split("_"))


def _named_enum(enum: str, names, doc: str) -> list[str]:
    """``enum class <enum>`` numbered in order, its count, its names and ``name()`` / ``index_of()``."""
    names = list(names)
    return [f"// {doc}",
            f"enum class {enum} : int {{ " + ", ".join(f"{_c_ident(n)} = {i}" for i, n in enumerate(names)) + " };",
            f"constexpr int kNum{enum}s = {len(names)};",
            f"constexpr const char* k{enum}Names[kNum{enum}s] = {{" + ", ".join(map(_c_str, names)) + "};",
            f"constexpr const char* name({enum} v) {{ return k{enum}Names[static_cast<int>(v)]; }}",
            f"constexpr int index_of({enum} v) {{ return static_cast<int>(v); }}", ""]


def emit_plugin_header() -> str:
    """seam_generated.h: what the TensorRT plugin (trtllm_mk/plugin/trt) takes from this file, in
    namespace ``trtllm_mk_seam``. Self-contained C++17 (<cstdint>, <vector>); needs no CUDA or TensorRT."""
    ns = PLUGIN_HEADER_NAMESPACE
    lines = ["// Generated from trtllm_mk/seam.py (emit_plugin_header) when the TensorRT plugin is built:",
             "//   python -I trtllm_mk/seam.py --plugin-header " + PLUGIN_HEADER_NAME,
             "// Do not edit and do not commit: change trtllm_mk/seam.py.",
             "#pragma once", "", "#include <cstdint>", "#include <vector>", "",
             "// The kernel.json dims keys in order, as an X-macro: X(key) once per key.",
             "#define TRTLLM_MK_SEAM_KERNEL_DIMS(X) " + " ".join(f"X({_c_ident(k)})" for k in KERNEL_DIM_KEYS), "",
             f"namespace {ns} {{", "",
             "// The plugin's identity in TensorRT's plugin registry.",
             f"constexpr const char* kPluginName = {_c_str(TRT_PLUGIN_NAME)};",
             f"constexpr const char* kPluginVersion = {_c_str(TRT_PLUGIN_VERSION)};",
             f"constexpr const char* kPluginNamespace = {_c_str(TRT_PLUGIN_NAMESPACE)};", "",
             "// The plugin's inputs before the layers' weights, then per layer kNumLayerFields inputs.",
             "enum InputIndex : int { " + ", ".join(f"{_camel(n)} = {i}" for i, n in enumerate(TRT_PLUGIN_FIXED_INPUTS))
             + " };",
             f"constexpr int kNumFixedInputs = {len(TRT_PLUGIN_FIXED_INPUTS)};",
             "constexpr const char* kFixedInputNames[kNumFixedInputs] = {"
             + ", ".join(map(_c_str, TRT_PLUGIN_FIXED_INPUTS)) + "};",
             "enum OutputIndex : int { " + ", ".join(f"{_camel(n)} = {i}" for i, n in enumerate(TRT_PLUGIN_OUTPUTS))
             + " };",
             f"constexpr int kNumOutputs = {len(TRT_PLUGIN_OUTPUTS)};",
             "constexpr const char* kOutputNames[kNumOutputs] = {" + ", ".join(map(_c_str, TRT_PLUGIN_OUTPUTS)) + "};",
             ""]
    lines += _named_enum("KernelDim", KERNEL_DIM_KEYS, "kernel.json \"dims\" keys: "
                         + ", ".join(f"{k} {doc}" for k, _, doc in KERNEL_DIMS))
    lines += _named_enum("LayerField", LAYER_FIELD_NAMES, "mk::LayerWeights members in table order (the plugin's "
                         "per-layer input order too)")
    lines += ["constexpr const char* kLayerFieldHfSuffixes[kNumLayerFields] = {"
              + ", ".join(_c_str(w.hf_suffix) for w in LAYER_WEIGHTS) + "};",
              "// Absent in some model families (a null pointer then; a 1-element placeholder input for the plugin).",
              "constexpr bool kLayerFieldOptional[kNumLayerFields] = {"
              + ", ".join("true" if w.optional else "false" for w in LAYER_WEIGHTS) + "};",
              f"constexpr int kNumOptionalLayerFields = {sum(w.optional for w in LAYER_WEIGHTS)};", "",
              "// Each layer weight's shape (HF layout) from a struct holding the kernel.json dims as integer members.",
              "template <class Dims>", "std::vector<std::vector<int64_t>> layer_weight_shapes(const Dims& d) {",
              "  return {"]
    for w in LAYER_WEIGHTS:
        axes = ", ".join(" * ".join(f"d.{_c_ident(k)}" for k in axis)
                         for axis in LAYER_WEIGHT_SHAPES[w.field])
        lines.append(f"      std::vector<int64_t>{{{axes}}},  // {w.field}")
    lines += ["  };", "}", ""]
    layout, size = params_layout()
    lines += _named_enum("Param", [f.name for f in PARAMS], "mk::Params fields in struct order")
    lines += ["struct ParamFieldInfo {", "  const char* name;", "  const char* ctype;",
              "  const char* role;  // weight: model tensor; buffer: engine-owned memory; scalar: a value",
              "  int64_t offset;", "  int64_t size;", "};",
              "constexpr ParamFieldInfo kParams[kNumParams] = {"]
    lines += [f"    {{{_c_str(f.name)}, {_c_str(f.ctype)}, {_c_str(f.role)}, {off}, {n}}}," for f, off, n in layout]
    lines += ["};", f"constexpr int64_t kParamsSize = {size};  // sizeof(mk::Params)", ""]
    lines += _named_enum("ErrorField", [f for f, _ in ERROR_FIELDS], "mk::ErrorInfo's 32-bit words in order")
    lines += ["// ErrorInfo.code values.",
              "enum class ErrorCode : uint32_t { " + ", ".join(f"{_c_ident(k)} = {v}" for k, v in ERROR_CODES.items())
              + " };",
              "struct ErrorCodeInfo {", "  const char* name;", "  uint32_t code;", "};",
              f"constexpr int kNumErrorCodes = {len(ERROR_CODES)};",
              "constexpr ErrorCodeInfo kErrorCodes[kNumErrorCodes] = {"
              + ", ".join(f"{{{_c_str(k)}, {v}}}" for k, v in ERROR_CODES.items()) + "};",
              "constexpr const char* name(ErrorCode c) {",
              "  for (const ErrorCodeInfo& e : kErrorCodes)",
              "    if (e.code == static_cast<uint32_t>(c)) return e.name;",
              "  return \"\";", "}", "",
              f"}}  // namespace {ns}"]
    return "\n".join(lines) + "\n"


def write_plugin_header(path) -> bool:
    """Write emit_plugin_header() to ``path`` unless it already holds exactly that; True when written."""
    from pathlib import Path
    path, text = Path(path), emit_plugin_header()
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk.seam", description="Emit the seam's generated C++.")
    ap.add_argument("--plugin-header", metavar="OUT", required=True,
                    help=f"write the TensorRT plugin's {PLUGIN_HEADER_NAME} to OUT")
    args = ap.parse_args(argv)
    write_plugin_header(args.plugin_header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
