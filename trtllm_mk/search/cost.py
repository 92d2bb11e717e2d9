"""Roofline cost of every task of a step graph, in the terms the simulator needs.

Per SM rates (bytes or FLOPs per microsecond):
  stream weight streaming of a GEMV kind: read_bandwidth / (SMs that run tasks of that kind), at
         most ``sm_bw_cap`` x the fair share read_bandwidth / sm_count and never below it. Phases
         of one kind mostly run alone (whole-layer events separate them), so the SMs that take part
         in a phase share the bandwidth; an SM without work in a phase leaves its share to others.
  hbm    the fair share, for KV-cache and embedding reads (they overlap other SMs' streaming).
  l2     activations (L2-resident): ``l2_bw_factor`` x the fair HBM share.
  norm   the residual x an RMSNorm kind stages: ``norm_stage_bw_factor`` x the fair share.
  gemv   consumer rate in weight bytes: the tensor-core consumer (mma.m16n8k16, batch <= 8 as the N
         columns) is bound by the shared-memory reads of its weight tiles (ldmatrix), not by math, so
         its rate is shared-memory bytes per clock x clock x ``consumer_efficiency`` at any batch.
  attn   fp32 FMA lanes x clock x efficiency (q in registers, K/V from the ring or global memory).
Both consumer rates scale down with fewer consumer warps than ``full_rate_warps``.

A GEMV task has two sides (see simulate.py): the loader streams its ``weight`` bytes through the ring
at ``rate`` = min(hbm share, ring round-trip bound, consumer pace, copy issue rate), where a ring of ``ring`` bytes in
slots of ``fill`` bytes turns over once per (latency + fill / hbm + per-slot consume time); the
consumer spends ``pre`` (overhead + staging the activation from L2: dependent passes x the loaded L2
latency + bytes over the L2 rate), then ``comp`` on the math. ``fill`` is the task's bytes per slot: a
task whose rows end in a part-empty row group streams fewer bytes through each slot, while its
consumers still reduce every 16-row block of every slot (``comp`` counts whole slots).
Other kinds take ``dur`` on the consumer: ATTN its traced fixed latency (q/k/v from L2, RoPE, the
merge) plus its tile rounds or, for cached tokens beyond what the loader brings through the ring
before the wait (smem.attention_kv_ring), the loader's stream of the later rounds where that is
slower (kinds/attn.py duration_us).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..gpus import GpuSpec
from ..graph.tasks import HEAD, LAYER, TAIL, Kind, StepGraph, Task
from ..kinds.attn import ATTN_TILE_TOKENS
from ..kinds.combine import merge_cost, merge_units
from ..smem import SlotGeometry, norm_staging_passes, slot_geometry
from .calibration import Calibration, load_calibration

__all__ = ["Calibration", "load_calibration", "Rates", "sm_rates", "TaskCost", "CostTable", "task_cost", "staging_passes",
           "ring_turnover_rate",
           "merge_units", "merge_cost", "ATTN_TILE_TOKENS",
           "cost_table", "default_streaming", "streaming_key", "Streaming"]



Streaming = tuple[tuple[int, int], ...]   # ((kind, SMs streaming that kind), ...), sorted: a dict key


def streaming_key(counts: dict) -> Streaming:
    return tuple(sorted((int(k), int(v)) for k, v in counts.items()))


@dataclass(frozen=True)
class Rates:
    hbm: float     # bytes/us, fair share
    l2: float      # bytes/us
    norm: float    # bytes/us: the RMSNorm kinds' staged x
    gemv: float    # weight bytes/us the consumer warps reduce
    attn: float    # FLOP/us
    stream: dict   # kind (int) -> bytes/us while streaming that kind's weights

    def stream_rate(self, kind: Kind) -> float:
        return self.stream.get(int(kind), self.hbm)


def sm_rates(gpu: GpuSpec, cal: Calibration, batch: int, streaming: Streaming = (), consumer_warps: int = 8) -> Rates:
    """Per-SM rates; ``streaming`` gives how many SMs stream each GEMV kind (absent: all SMs)."""
    c = cal.resolved(gpu)
    bw = c.read_bandwidth / 1e6                      # bytes/us
    fair = bw / gpu.sm_count
    stream = {k: min(c.sm_bw_cap * fair, max(fair, bw / max(1, n))) for k, n in streaming}
    clk = c.sm_clock_ghz * 1e3                       # clocks/us
    # fewer warps than full_rate_warps cannot hide shared-memory and mma latency
    eff = c.consumer_efficiency * min(1.0, consumer_warps / c.full_rate_warps)
    gemv = eff * clk * c.smem_bytes_per_clk
    attn = 2.0 * eff * clk * c.fp32_lanes
    return Rates(hbm=fair, l2=c.l2_bw_factor * fair, norm=c.norm_stage_bw_factor * fair, gemv=gemv, attn=attn,
                 stream=stream)


@dataclass(frozen=True)
class TaskCost:
    gemv: bool
    weight: float = 0.0    # bytes streamed through the ring
    pre: float = 0.0       # us: consumer overhead + activation staging
    comp: float = 0.0      # us: consumer math over all slots
    slot_t: float = 0.0    # us: consumer time per slot
    fill: float = 0.0      # bytes per slot
    ring: float = 0.0      # bytes the ring holds for this kind (stages x fill)
    rate: float = 0.0      # bytes/us the loader sustains on this task
    dur: float = 0.0       # us: whole consumer time of a non-GEMV task
    stage: float = 0.0     # us: the staging part of pre (skipped after a task that staged the same input)


def staging_passes(kind: Kind, hidden: int, batch: int, consumer_warps: int) -> int:
    """Dependent L2 passes of the activation staging (mk_gemv.cuh): RMSNorm kinds take
    ``norm_staging_passes``; OPROJ / DOWN copy a slice."""
    return norm_staging_passes(hidden, batch, consumer_warps) if kind.module.NORMS_INPUT else 1


def remote_add_us(task: Task, dims, cal: Calibration) -> float:
    """Under tensor parallelism the adds a task declares into the residual x go to every rank (the
    all-reduce fused into the epilogue): the (tp - 1) remote copies' 8-byte reductions over the link."""
    if dims.tensor_parallel <= 1:
        return 0.0
    elems = sum(w.hi - w.lo for w in task.writes if w.add and w.buf == "x") * dims.batch
    return elems * 8 / 1024 * (dims.tensor_parallel - 1) * cal.link_add_us_per_kb


def ring_turnover_rate(ring: float, fill: float, bw: float, slot_t: float, cal: Calibration) -> float:
    """Bytes/us a loader keeps streaming through a ring of ``ring`` bytes in slots of ``fill`` bytes
    (Little's law): a slot turns over once per memory latency, its bytes at ``bw`` and the consumer's
    ``slot_t`` on it."""
    return ring / (cal.mem_latency_us + fill / bw + slot_t)


def task_cost(task: Task, graph: StepGraph, rates: Rates, cal: Calibration,
              geo: SlotGeometry | None = None) -> TaskCost:
    plan, d = graph.plan, graph.dims
    off_ring = getattr(task.kind.module, "off_ring", None)   # a GEMV kind that reads its weights itself under the plan
    if task.kind.streams_weights and not (off_ring is not None and off_ring(plan)):
        qw = d.weight_bits != 16 and task.kind != Kind.LMHEAD   # quantized layer weights (the LM head is bf16)
        if geo is None:
            geo = slot_geometry(task.k1 - task.k0, task.kind.module.MATRICES, plan.slot_bytes,
                                plan.consumer_warps, d.weight_bits if qw else 16, d.weight_group if qw else 0,
                                d.weight_tile if qw else 0)
        nslots = geo.slots_for(task.rows)
        ngroups = -(-task.rows // geo.out_rows)
        extra = getattr(task.kind.module, "extra_ring_slots", None)
        if extra is not None:   # a second weight stream in the same task (EMLP's down part)
            more_slots, more_groups = extra(task, plan, d)
            nslots, ngroups = nslots + more_slots, ngroups + more_groups
        # the consumers reduce whole slots (every 16-row block, valid rows or not), while the loader
        # copies only a partial last group's rows: a task whose rows are not a multiple of the slot
        # group's streams fewer bytes per slot through the same ring (fill) at the same consumer cost
        # the consumer's work is per weight: a quantized slot costs its bf16-equivalent bytes, dequantized
        work = geo.rows_per_slot * geo.mean_chunk * 2 * (cal.quant_consumer_cost if qw else 1.0)
        comp = nslots * work / rates.gemv + nslots * cal.slot_overhead(qw) + ngroups * cal.group_overhead_us
        comp += remote_add_us(task, d, cal)
        slot_t = comp / nslots
        fill = task.weight_bytes / nslots
        ring = plan.stages * fill
        bw = rates.stream_rate(task.kind)
        issue = geo.copy_bytes / cal.copy_issue_us   # bulk copies issue at a fixed cost each
        rate = min(bw, ring_turnover_rate(ring, fill, bw, slot_t, cal), task.weight_bytes / comp, issue)
        act_rate = rates.norm if task.kind.module.NORMS_INPUT else rates.l2
        stage = staging_passes(task.kind, d.hidden, d.batch, plan.consumer_warps) * cal.l2_latency_us + task.act_bytes / act_rate
        stage += task.kind.module.staging_extra_us(task, graph, cal)
        return TaskCost(True, float(task.weight_bytes), cal.task_overhead(qw) + stage, comp,
                        slot_t, fill, ring, rate, stage=stage)
    dur = task.kind.module.duration_us(task, graph, rates, cal)
    return TaskCost(False, dur=dur)


@dataclass(frozen=True)
class CostTable:
    """Costs aligned with graph.head / graph.layer / graph.tail."""
    head: list[TaskCost]
    layer: list[TaskCost]
    tail: list[TaskCost]
    rates: Rates
    streaming: Streaming

    def phase(self, phase: str) -> list[TaskCost]:
        return {HEAD: self.head, LAYER: self.layer, TAIL: self.tail}[phase]


def default_streaming(graph: StepGraph, num_sms: int) -> Streaming:
    """Before an assignment exists: each kind spread over as many SMs as it has tasks."""
    tasks: dict[int, int] = {}
    for t in graph.head + graph.layer + graph.tail:
        if t.kind.streams_weights:
            tasks[int(t.kind)] = tasks.get(int(t.kind), 0) + 1
    return streaming_key({k: min(num_sms, n) for k, n in tasks.items()})


def cost_table(graph: StepGraph, gpu: GpuSpec, cal: Calibration, streaming: Streaming | None = None) -> CostTable:
    """Costs of every task; ``streaming`` as in sm_rates (default: default_streaming over all SMs)."""
    c = cal.resolved(gpu)
    key = default_streaming(graph, gpu.sm_count) if streaming is None else streaming
    rates = sm_rates(gpu, c, graph.batch, key, graph.plan.consumer_warps)
    memo: dict[tuple, TaskCost] = {}

    def cost(t: Task) -> TaskCost:
        # tasks of one kind and shape cost the same: a layer has thousands of them, a few shapes
        key = (t.kind, t.r1 - t.r0, t.k1 - t.k0, t.weight_bytes, t.act_bytes, t.flops)
        if key not in memo:
            memo[key] = task_cost(t, graph, rates, c)
        return memo[key]

    return CostTable([cost(t) for t in graph.head], [cost(t) for t in graph.layer], [cost(t) for t in graph.tail],
                     rates, key)
