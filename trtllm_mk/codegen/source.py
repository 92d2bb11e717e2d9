"""Emit the config-specialized CUDA source of the megakernel from a Schedule.

The output is one self-contained .cu file: a ``namespace cfg`` block with every shape, tile choice and
event count as a compile-time constant, the device headers of trtllm_mk/device inlined, and
``run_program``: for each SM a straight-line list of task calls (head, a loop over layers of the
SM's layer program, tail). Nothing is decided at run time but the SM's own case of one switch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..graph import LAYER, Kind, StepGraph, Task, check_kernel_supported
from ..kinds import device_files
from .diagnostics import Diagnostics
from ..residual import COUNT_BITS as RESID_COUNT_BITS, FRAC_BITS as RESID_FRAC_BITS, counted_states
from ..schedule import Schedule
from ..seam import emit_cuda, emit_cuda_preamble, event_ref_word, task_args_init
from ..smem import (ACT_PAD, MAX_BLOCKS, ROW_PAD, SIG_SLOTS, SLOT_PAD, TRACE_ACCS, SmemLayout, activation_bytes, geometries,
                    kv_region_bytes, kv_ring_offset, norm_staging_passes, plan_kv_ring, smem_layout, split_start)

KERNEL_NAME = "mk_decode_step"
MAX_REFS = 4  # TaskArgs holds up to 4 waits and 4 signals
# Warps that fill the weight ring. Bulk copies: one (a copy per row, issued by its lanes). 16-byte
# cp.async copies: three, taking the rows of a slot in turn, because a warp's issue rate bounds the
# stream (benchmarks/NOTES.md has the measurements). A sub-partition holds the registers of at most
# three warps at the 168-register cap, so a CTA of 8 consumer warps, three loaders and the signaller
# (12 warps) keeps the cap of two loaders, where a fourth loader would lower it to 128 registers.
CP_ASYNC_LOADER_WARPS = 3
MAX_CP_ASYNC_LOADER_WARPS = 8


def loader_warps_for(use_bulk_copy: bool, loader_warps: int | None = None) -> int:
    """The weight ring's loader warps: one for bulk copies, ``loader_warps`` (default
    CP_ASYNC_LOADER_WARPS) for the cp.async ring."""
    if use_bulk_copy:
        if loader_warps not in (None, 1):
            raise ValueError(f"loader_warps {loader_warps}: the bulk-copy ring has one loader warp")
        return 1
    if loader_warps is None:
        return CP_ASYNC_LOADER_WARPS
    if not 1 <= loader_warps <= MAX_CP_ASYNC_LOADER_WARPS:
        raise ValueError(f"loader_warps {loader_warps}: the cp.async ring takes 1..{MAX_CP_ASYNC_LOADER_WARPS}")
    return loader_warps


HEADER_ORDER = ["mk_common.cuh", "mk_params.cuh", "mk_gemv.cuh", "mk_sampling.cuh", "mk_kernel.cuh"]


def device_source_dir() -> Path:
    """The device sources, shipped inside the package (package data)."""
    return Path(__file__).resolve().parent.parent / "device"


@dataclass(frozen=True)
class KernelLayout:
    """What the host needs to launch the generated kernel."""
    grid: int
    block: int
    smem_bytes: int
    event_offsets: dict[str, int]
    num_counters: int
    n_lm_tiles: int
    history_len: int
    tokens_per_block: int
    trace_tasks: int = 0   # most tasks any SM runs per step (rows per SM of the optional trace)
    tensor_parallel: int = 1   # ranks (each runs this kernel with its own rank and peers)


def _event_layout(graph: StepGraph) -> tuple[dict[str, int], list[int], list[int]]:
    """(first counter of each event, signals a counter receives per step, whether it is cross-rank).
    A cross-rank counter receives every rank's signals (graph.builder, tensor parallelism)."""
    offsets, counts, cross = graph.counter_offsets(), [], []
    tp = graph.dims.tensor_parallel
    for name in sorted(graph.events):
        ev = graph.events[name]
        assert offsets[name] == len(counts)
        for row in ev.counts:
            counts.extend(c * (tp if ev.cross_rank else 1) for c in row)
            cross.extend([int(ev.cross_rank)] * len(row))
    return offsets, counts, cross


def act_smem_bytes(graph: StepGraph) -> int:
    """The activation region's need (unaligned): trtllm_mk/smem.py activation_bytes."""
    d = graph.dims
    return activation_bytes(d.hidden, d.q_dim, d.intermediate, d.group, d.head_dim, d.batch, graph.plan)


def kernel_smem_layout(graph: StepGraph) -> SmemLayout:
    """The kernel's shared-memory layout (emitted as the SMEM_* constants)."""
    return smem_layout(graph.plan, graph.dims.batch, act_smem_bytes(graph))


def kernel_smem_bytes(graph: StepGraph) -> int:
    """Dynamic shared memory per CTA."""
    return kernel_smem_layout(graph).total


def _smem_constants(layout: SmemLayout, slot_stride: int) -> str:
    """The shared-memory layout for the device (namespace mk): each region's offset and size."""
    lines = ["namespace mk {", "// Dynamic shared memory: [ring][activation / attention scratch][red][scratch][mbarriers]",
             f"constexpr int SLOT_STRIDE = {slot_stride};   // a ring slot: weights + row skew (SLOT_PAD)",
             f"constexpr int SIG_SLOTS = {SIG_SLOTS};   // signal queue entries, consumers -> signaller warp",
             f"constexpr int TRACE_ACCS = {TRACE_ACCS};   // trace accumulators after the chain hint",
             f"constexpr int ROW_PAD = {ROW_PAD};   // bytes of skew after each weight row in a slot",
             f"constexpr int ACT_PAD = {ACT_PAD};   // bf16 of skew after each staged activation row",
             f"constexpr int MAX_BLOCKS = {MAX_BLOCKS};   // 16-row blocks per slot (SLOT_PAD covers their skew)"]
    for r in layout.regions:
        lines.append(f"constexpr size_t SMEM_{r.name.upper()}_AT = {r.offset}, SMEM_{r.name.upper()} = {r.size};")
    lines += [f"constexpr size_t SMEM_TOTAL = {layout.total};", "}  // namespace mk"]
    return "\n".join(lines) + "\n"


def _ref_expr(graph: StepGraph, task: Task, ref, offsets: dict[str, int]) -> str:
    """The reference's TaskArgs word: its counter in layer 0, and for LAYER tasks the event's row
    stride (the device adds layer x stride: seam.event_ref_word)."""
    ev = graph.events[ref.event]
    index = offsets[ref.event] + ref.index * ev.slots + ref.slot
    return hex(event_ref_word(index, ev.slots if task.phase == LAYER else 0))


@dataclass(frozen=True)
class TaskCall:
    """One call of the generated ``run_program``: the device function (``run_task`` or
    ``prefetch_next_step``), the task's kind and its TaskArgs values (C expressions, in
    seam.TASK_ARGS order; waits and signals as lists)."""
    function: str
    kind: str
    args: dict

    @property
    def name(self) -> str:
        """The function as ptxas reports it, by kind (engine.kernel_function_name's form)."""
        return f"{self.function}<{self.kind}>"

    def words(self) -> tuple[str, ...]:
        """The arguments as the flat words of one TaskArgs."""
        return tuple(x for v in self.args.values() for x in (v if isinstance(v, list) else [v]))

    def render(self) -> str:
        ns = "mk::" if self.function != "run_task" else ""
        return f"c = {ns}{self.function}<mk::{self.kind}>(c, {task_args_init(self.args)});"


def _task_call(graph: StepGraph, task: Task, offsets: dict[str, int], prev: Task | None, counted) -> TaskCall:
    """``counted(event name)``: whether the device keeps the event's counter (device_events)."""
    if len(task.waits) > MAX_REFS or len(task.signals) > MAX_REFS:
        raise ValueError(f"{task.label()}: more than {MAX_REFS} waits/signals; use smaller qkv_rows")
    layer = "l" if task.phase == LAYER else "-1"
    waits = [r for r in task.waits if counted(r.event)]
    if not all(counted(r.event) for r in task.signals[:task.staged_signals]):
        raise ValueError(f"{task.label()}: a polled event cannot be a staged signal")
    signals = [r for r in task.signals if counted(r.event)]
    w = [_ref_expr(graph, task, r, offsets) for r in waits] + ["0"] * (MAX_REFS - len(waits))
    s = [_ref_expr(graph, task, r, offsets) for r in signals] + ["0"] * (MAX_REFS - len(signals))
    tile = task.index if task.kind == Kind.LMHEAD else task.slot   # expert kinds: the slot
    stage = 0 if prev is not None and task.reuses_staged_input(prev) else 1
    args = _task_args(layer, task, task.group, task.split, tile, stage, w, len(waits), s, len(signals),
                      task.staged_signals)
    return TaskCall("run_task", task.kind.name, args)


def device_events(graph: StepGraph, diagnostics: Diagnostics = Diagnostics()):
    """Whether the kernel keeps an event's counter: every event but the polled ones (their waiters poll
    the tagged data), unless the diagnostic switch polled_events is off."""
    return lambda name: not (graph.events[name].polled and diagnostics.polled_events)


def _task_args(layer: str, task: Task, group: int, split: int, tile: int, stage: int, w: list[str], nw: int,
               s: list[str], ns: int, nss: int = 0) -> dict:
    """An mk::TaskArgs's values (trtllm_mk/seam.py TASK_ARGS)."""
    if nss and not task.kind.streams_weights:
        raise ValueError(f"{task.label()}: staged signals need a GEMV kind (published after its staging)")
    return dict(layer=layer, r0=task.r0, r1=task.r1, k0=task.k0, k1=task.k1, group=group, split=split,
                tile=tile, stage=stage, nw=nw, w=w, ns=ns, s=s, nss=nss)


def _prefetch_call(task: Task) -> TaskCall:
    """The SM's first layer-template GEMV task, as layer 0 of the next step: what its loader streams
    first, for mk_gemv.cuh prefetch_next_step (a no-op with the diagnostic switch prefetch_next off)."""
    none = ["0"] * MAX_REFS
    return TaskCall("prefetch_next_step", task.kind.name, _task_args("0", task, 0, 0, 0, 0, none, 0, none, 0))


def program_calls(schedule: Schedule, graph: StepGraph | None = None,
                  diagnostics: Diagnostics = Diagnostics()) -> list[list[tuple[str, TaskCall]]]:
    """Per SM, the calls of its case of ``run_program`` in order, each with its section: "head", "layer"
    (inside the loop over layers), "tail" or "prefetch"."""
    graph = graph or schedule.graph()
    offsets = graph.counter_offsets()
    counted = device_events(graph, diagnostics)
    out = []
    for prog in schedule.programs:
        calls = []
        for section, ids, tasks in (("head", prog.head, graph.head), ("layer", prog.layer, graph.layer),
                                    ("tail", prog.tail, graph.tail)):
            # a task may reuse the staged activation only of its predecessor in the same list (the same
            # layer iteration); the first task of a list always stages
            for i, j in zip([None] + ids[:-1], ids):
                calls.append((section, _task_call(graph, tasks[j], offsets, tasks[i] if i is not None else None,
                                                  counted)))
        first = next((graph.layer[j] for j in prog.layer if graph.layer[j].kind.streams_weights), None)
        if first is not None:
            calls.append(("prefetch", _prefetch_call(first)))
        out.append(calls)
    return out


def shared_call_arguments(schedule: Schedule) -> dict[str, tuple]:
    """Per device function called from ``run_program`` (TaskCall.name), the TaskArgs words every call
    of it passes alike: the literal where all calls agree, None where they differ or the value is only
    known at run time (the layer index). The compiler propagates the agreed values into the function's
    body, so they shape its code (and its registers) as much as the plan's compile-time constants."""
    shared: dict[str, tuple] = {}
    for calls in program_calls(schedule):
        for section, call in calls:
            words = tuple(map(str, call.words()))
            if section == "layer":   # the loop's layer index is known only at run time
                words = (None,) + words[1:]
            prev = shared.get(call.name)
            shared[call.name] = words if prev is None else tuple(a if a == b else None for a, b in zip(prev, words))
    return shared


def _host_model_checks(schedule: Schedule, kv_cap: int) -> str:
    """static_asserts, after the device headers, that the ring arithmetic the host models (slot
    geometry per GEMV kind, the ATTN K/V skew) is the device's, for this kernel's constants."""
    d = schedule.graph().dims
    out = ["// ===== the host's ring model (trtllm_mk/smem.py) against the device's =====", "namespace host_model {"]
    for kind, g in geometries(schedule.spec, schedule.plan).items():
        k = kind.name
        out.append(f"using {k} = mk::GemvGeometry<mk::{k}>;")
        out.append(f"static_assert({k}::NKC == {g.pieces} && {k}::KC == {g.k_chunk} && {k}::KC_LAST == {g.last_chunk} "
                   f"&& {k}::RS == {g.rows_per_slot}, "
                   f"\"{k} ring geometry: smem.py slot_geometry\");")
    run = schedule.plan.attn_kv_run
    out.append(f"static_assert(mk::KV_REGION == {kv_region_bytes(d.head_dim, kv_cap, run)}, "
               f"\"ATTN K/V region: smem.py kv_region_bytes\");")
    for u in sorted({0, run - 1, run, 8 * run - 1, 8 * run, kv_cap - 1}):
        out.append(f"static_assert(mk::kv_ring_offset({u}) == {kv_ring_offset(u, d.head_dim, run)}, "
                   f"\"ATTN K/V skew: smem.py kv_ring_offset\");")
    for n in sorted({1, d.splits * run + 1, d.splits * kv_cap + 1, d.context_len + 1, 4 * d.splits * kv_cap + 3}):
        for s in sorted({1, d.splits // 2, d.splits - 1, d.splits}):
            out.append(f"static_assert(mk::split_start({n}, {s}) == {split_start(n, d.splits, run, kv_cap, s)}, "
                       f"\"ATTN split bounds: smem.py split_start\");")
    out.append("}  // namespace host_model")
    return "\n".join(out) + "\n"


def _inline_headers(smem: SmemLayout, slot_stride: int, kinds: set[str]) -> str:
    out = []
    src = device_source_dir()
    # the device files of the step's kinds (trtllm_mk.kinds.device_files) go between the shared
    # headers and the kernel: a dense model's kernel carries no expert bodies
    for path in [src / n for n in HEADER_ORDER[:-1]] + device_files(kinds) + [src / HEADER_ORDER[-1]]:
        name, text = path.name, path.read_text()
        if name == "mk_common.cuh":   # ErrorInfo, which the shared basics use
            out.append(f"// ===== trtllm_mk/seam.py (generated) =====\n{emit_cuda_preamble()}")
        text = re.sub(r'^#pragma once\s*$', "", text, flags=re.M)
        text = re.sub(r'^#include "mk_[a-z_]+\.cuh"\s*$', "", text, flags=re.M)
        out.append(f"// ===== {name} =====\n{text}")
        if name == "mk_common.cuh":   # the interface declarations follow the shared basics
            out.append(f"// ===== trtllm_mk/seam.py (generated) =====\n{emit_cuda()}")
            out.append(f"// ===== shared-memory layout (trtllm_mk/smem.py smem_layout) =====\n"
                       f"{_smem_constants(smem, slot_stride)}")
    return "\n".join(out)


def generate_source(schedule: Schedule, tokens_per_block: int, max_seq_len: int,
                    use_bulk_copy: bool, diagnostics: Diagnostics = Diagnostics(),
                    loader_warps: int | None = None) -> tuple[str, KernelLayout]:
    """``diagnostics``: the kernel's diagnostic switches (codegen/diagnostics.py); the default is the
    production kernel. ``loader_warps``: the cp.async ring's loader warps (loader_warps_for)."""
    graph = schedule.graph()
    d, p, spec = graph.dims, graph.plan, schedule.spec
    check_kernel_supported(spec)
    offsets, counts, cross = _event_layout(graph)
    smem_map = kernel_smem_layout(graph)
    smem = smem_map.total
    trace_tasks = max((len(pr.head) + d.layers * len(pr.layer) + len(pr.tail) for pr in schedule.programs), default=0)
    lines = [
        "// Generated by trtllm_mk.codegen from schedule.json: do not edit.",
        f"// model {spec.name} ({spec.family}), batch {d.batch}, {schedule.num_sms} SMs, GPU {schedule.gpu}",
        "#include <cuda_bf16.h>",
        "#include <stdint.h>",
        "#define MK_USE_BULK_COPY 1" if use_bulk_copy else "// weight ring filled with cp.async (no bulk copy engine)",
        diagnostics.emit_cuda() + "namespace cfg {",
    ]
    kv_slots, kv_cap = plan_kv_ring(d.head_dim, p, d.context_len)
    loader_warps = loader_warps_for(use_bulk_copy, loader_warps)
    consts = dict(B=d.batch, L=d.layers, H=d.hidden, I=d.intermediate, V=d.vocab, NH=d.heads, NKV=d.kv_heads, D=d.head_dim, G=d.group,
                  S=d.splits, GR=d.group_rows, QKVR=d.qkv_rows, QD=d.q_dim, TPB=tokens_per_block, HISTORY_LEN=max_seq_len,
                  NUM_SMS=schedule.num_sms, STAGES=p.stages, SLOT_BYTES=p.slot_bytes, CWARPS=p.consumer_warps,
                  O_KSPLIT=p.o_ksplit, DOWN_KSPLIT=p.down_ksplit, N_LM_TILES=d.n_lm_tiles,
                  ACT_SMEM_BYTES=act_smem_bytes(graph), NUM_COUNTERS=len(counts), SLOT_PAD=SLOT_PAD,
                  TRACE_TASKS=max(1, trace_tasks), KV_SLOTS=kv_slots, KV_CAP=kv_cap, KV_RUN=p.attn_kv_run,
                  INFLIGHT=p.inflight_slots, INFLIGHT_CHAIN=p.inflight_chain,
                  INFLIGHT_EXPERT=p.expert_inflight or p.stages, MAX_REFS=MAX_REFS,
                  RESID_FRAC_BITS=RESID_FRAC_BITS, RESID_COUNTED=int(d.resid_counted), RESID_COUNT_BITS=RESID_COUNT_BITS,
                  RESID_O_ADDS=d.resid_o_adds, RESID_LAYER_ADDS=d.resid_layer_adds,
                  RESID_STATES=counted_states(d.layers, d.resid_layer_adds) if d.resid_counted else 0, WBITS=spec.weight_bits, QGROUP=spec.weight_group,
                  QTILE=graph.dims.weight_tile, TP=d.tensor_parallel, LM_TILES_ALL=d.tensor_parallel * d.n_lm_tiles,
                  E=d.experts, TOPK=d.experts_per_token, NSLOT=d.expert_slots,
                  LOADER_WARPS=loader_warps, NORM_PASSES=norm_staging_passes(d.hidden, d.batch, p.consumer_warps))
    kinds = {t.kind for t in graph.head + graph.layer + graph.tail}
    for kind in sorted(kinds):   # what the step's kinds' device files read beyond the shared constants
        hook = getattr(kind.module, "device_constants", None)
        extra = hook(graph) if hook is not None else {}
        clash = sorted(set(extra) & set(consts))
        if clash:
            raise ValueError(f"kind {kind.name}: device constants {clash} clash with the kernel's")
        consts.update(extra)
    for k, v in consts.items():
        lines.append(f"constexpr int {k} = {v};")
    lines.append(f"constexpr bool QK_NORM = {'true' if spec.qk_norm else 'false'};")
    lines.append(f"constexpr bool QKV_BIAS = {'true' if spec.qkv_bias else 'false'};")
    lines.append(f"constexpr bool O_MERGE = {'true' if p.o_merge else 'false'};")
    lines.append(f"constexpr bool EXPERT_FUSED = {'true' if p.expert_fused else 'false'};   // kinds/router.py, emlp.py")
    staged = any(t.staged_signals for t in graph.head + graph.layer + graph.tail)
    lines.append(f"constexpr bool STAGED_SIGNALS = {'true' if staged else 'false'};   // some task has staged signals")
    lines.append(f"constexpr bool NORM_TOPK = {'true' if spec.norm_topk_prob else 'false'};   // renormalise the top-k weights")
    lines.append(f"constexpr float EPS = {spec.rms_norm_eps!r}f;")
    for name, off in offsets.items():
        lines.append(f"constexpr int EV_{name.upper()} = {off};")
    lines.append(f"__constant__ uint32_t EV_COUNT[{len(counts)}] = {{{', '.join(map(str, counts))}}};")
    lines.append(f"__constant__ uint8_t EV_CROSS[{len(cross)}] = {{{', '.join(map(str, cross))}}};   // signalled on every rank")
    lines.append("}  // namespace cfg")
    lines.append(_inline_headers(smem_map, p.slot_bytes + SLOT_PAD, {k.name for k in kinds}))
    lines.append(_host_model_checks(schedule, kv_cap))
    lines.append("__device__ mk::Ctx run_program(mk::Ctx c) {")
    lines.append("  using mk::run_task;")
    lines.append("  switch (blockIdx.x) {")
    for sm, calls in enumerate(program_calls(schedule, graph, diagnostics)):
        lines.append(f"  case {sm}: {{")
        in_loop = False
        for section, call in calls:
            if (section == "layer") != in_loop:
                lines.append("    for (int l = 0; l < cfg::L; ++l) {" if not in_loop else "    }")
                in_loop = not in_loop
            lines.append(("      " if in_loop else "    ") + call.render())
        if in_loop:
            lines.append("    }")
        lines.append("  } break;")
    lines.append("  default: break;")
    lines.append("  }")
    lines.append("  return c;")
    lines.append("}")
    layout = KernelLayout(grid=schedule.num_sms, block=(p.consumer_warps + loader_warps + 1) * 32, smem_bytes=smem,
                          event_offsets=offsets, num_counters=len(counts), n_lm_tiles=d.n_lm_tiles,
                          history_len=max_seq_len, tokens_per_block=tokens_per_block,
                          trace_tasks=max(1, trace_tasks), tensor_parallel=d.tensor_parallel)
    return "\n".join(lines) + "\n", layout
