"""The tile-plan space the search walks: candidate values per TilePlan field, and a starting plan.

Rows per GEMV task are proposed by *waves*: for m = 1, 2, ... the smallest multiple of 8 rows whose
task count (tiles x K-split) is at most m x num_sms, so every SM gets at most m equal tasks of the
kind and the per-SM byte imbalance of the phase is at most one tile. Finer tiles balance better and
cost consumer time the loader usually hides; the simulator decides.

Limits that keep plans executable and code generation bounded:
  * QKV tiles at most one KV group of rows (a tile then signals at most two groups; the kernel's
    task arguments hold three).
  * at most MAX_WAVES tasks per SM per kind, so a layer template stays < ~5 x 16 tasks per SM.
  * every plan must pass graph.check_plan and fit shared memory (smem.fits).
"""
from __future__ import annotations

from dataclasses import replace

from ..gpus import GpuSpec
from ..graph.builder import check_plan
from ..graph.tasks import KV_RUNS, TilePlan
from ..kinds.router import oproj_rows
from ..model.spec import ModelSpec
from ..smem import MMA_ROWS, attention_kv_ring, fits, gemv_k_ranges, geometries, plan_smem

MAX_WAVES = 16
LM_MAX_WAVES = 24
SLOT_SIZES = (4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536)
STAGES = (2, 3, 4, 5, 6, 8, 12, 16)
CONSUMER_WARPS = (4, 8)
MIN_ATTN_CHUNK = 16      # tokens per KV split at the deployment context
QUANTIZED_INFLIGHT = 4   # ring slots in flight for 4-bit weights (TilePlan.inflight_slots / inflight_chain)


def _ceil(x: int, unit: int) -> int:
    return max(unit, -(-x // unit) * unit)


def row_unit(spec: ModelSpec) -> int:
    """Row granularity of the decoder layers' GEMV tiles: 8, or 16 for quantized weights (their scale
    words travel per 16-row block)."""
    return 16 if spec.quantized else 8


def wave_rows(n: int, ksplit: int, num_sms: int, max_waves: int = MAX_WAVES, cap: int | None = None,
              unit: int = 8, copies: int = 1) -> list[int]:
    """Rows per task for 1..max_waves waves of tasks over num_sms SMs (deduplicated, descending);
    ``copies``: how many times the kind's tiles repeat (mlp_copies), each copy with its share of a wave."""
    out: list[int] = []
    for m in range(1, max_waves + 1):
        rows = _ceil(-(-n * ksplit // max(1, m * num_sms // copies)), unit)
        rows = min(rows, _ceil(n, unit))
        if cap is not None:
            rows = min(rows, cap // unit * unit)
        if rows not in out:
            out.append(rows)
    return out


def mlp_copies(spec: ModelSpec, batch: int) -> int:
    """How many times a layer's MLP tiles repeat: once per expert slot of a sparse model (each slot's
    EGATEUP / EDOWN tiles cover one expert's rows, kinds/route.py), else once. Waves count all of them."""
    return spec.moe_slots(batch) if spec.is_moe else 1


def _k_unit(spec: ModelSpec) -> int:
    """Columns a K-split chunk must be a multiple of: 64, and whole weight groups when quantized."""
    if not spec.quantized:
        return 64
    from ..quant.kernel_layout import tile_cols
    return max(tile_cols(spec), spec.weight_group)


def _o_splits(spec: ModelSpec, most: int) -> list[int]:
    return [k for k in range(1, min(spec.num_kv_heads, most) + 1) if spec.num_kv_heads % k == 0
            and (spec.q_size // k) % _k_unit(spec) == 0]


def _down_splits(spec: ModelSpec, most: int) -> list[int]:
    return [k for k in range(1, most + 1) if spec.mlp_intermediate % (_k_unit(spec) * k) == 0]


def ksplit_candidates(spec: ModelSpec) -> tuple[list[int], list[int]]:
    return _o_splits(spec, 8), _down_splits(spec, 8)


def smallest_fitting_ksplit(spec: ModelSpec, batch: int, gpu: GpuSpec) -> tuple[int, int]:
    """(o_ksplit, down_ksplit) with the smallest product that fits with the smallest ring; (1, 1)
    unless the whole-K activations alone overflow (large batch on a 99 KB GPU)."""
    o_ks, d_ks = _o_splits(spec, spec.num_kv_heads), _down_splits(spec, 16)
    # the smallest ring: two slots of the smallest size that holds one piece of every kind (4-bit
    # and 8-bit weights take whole tiles, which 4 KB may not hold)
    for o, d in sorted(((o, d) for o in o_ks for d in d_ks), key=lambda od: (od[0] * od[1], od)):
        for slot in SLOT_SIZES:
            if fits(gpu, spec, batch, TilePlan(o_ksplit=o, down_ksplit=d, stages=2, slot_bytes=slot)):
                return o, d
    raise ValueError(f"no tile plan fits {gpu.name}'s {gpu.smem_per_block_optin} B of shared memory at batch {batch}")


def attn_split_candidates(spec: ModelSpec, num_sms: int, context_len: int) -> list[int]:
    out = [1]
    s = 2
    while s <= 64 and spec.num_kv_heads * s <= 2 * num_sms and -(-context_len // s) >= MIN_ATTN_CHUNK:
        out.append(s)
        s *= 2
    return out


def attn_row_candidates(batch: int) -> list[int]:
    """Batch rows per ATTN task: 0 (all of them), then the row counts of 2..batch tasks per split."""
    return [0] + sorted({-(-batch // n) for n in range(2, batch + 1)}, reverse=True)


def attn_tasks_per_group(plan: TilePlan, batch: int) -> int:
    """ATTN tasks of one KV group: its splits times its tiles of batch rows."""
    return plan.attn_splits * -(-batch // (plan.attn_rows or batch))


def field_candidates(field: str, plan: TilePlan, spec: ModelSpec, num_sms: int, context_len: int, batch: int) -> list:
    """Values the coordinate search tries for one field, given the rest of ``plan``."""
    H, I, V = spec.hidden_size, spec.mlp_intermediate, spec.vocab_size
    copies = mlp_copies(spec, batch)
    gr = (spec.group_size + 2) * spec.head_dim
    u = row_unit(spec)
    if field == "qkv_rows":
        return wave_rows(spec.num_kv_heads * gr, 1, num_sms, cap=gr, unit=u)
    if field == "o_rows":
        return wave_rows(oproj_rows(spec, plan), plan.o_ksplit, num_sms, unit=u)
    if field == "gateup_rows":   # EMLP's tiles are whole tensor-core k-steps of its down part
        return wave_rows(I, 1, num_sms, unit=16 if plan.expert_fused else u, copies=copies)
    if field == "down_rows":
        return wave_rows(H, plan.down_ksplit, num_sms, unit=u, copies=copies)
    if field == "lm_rows":
        return wave_rows(V, 1, num_sms, max_waves=LM_MAX_WAVES)
    if field == "attn_splits":
        return attn_split_candidates(spec, num_sms, context_len)
    if field == "attn_rows":
        return attn_row_candidates(batch)
    if field == "attn_kv_run":
        # a run longer than 8 spaces a tile's 16 tokens that far apart: only where a round holds 16
        # runs are its tiles full. Half-empty tiles double the tile math that holds each round's
        # slots, which the cost model's turnover does not weigh enough to rank, so they are not offered
        cap = {r: attention_kv_ring(spec.head_dim, plan.slot_bytes, plan.attn_splits, context_len, r)[1] for r in KV_RUNS}
        return [r for r in KV_RUNS if r == KV_RUNS[0] or cap[r] >= 16 * r]
    if field == "consumer_warps":
        return list(CONSUMER_WARPS)
    raise KeyError(field)


def valid(plan: TilePlan, spec: ModelSpec, batch: int, gpu: GpuSpec) -> bool:
    try:
        check_plan(spec, plan, batch)
    except ValueError:
        return False
    return fits(gpu, spec, batch, plan)


def ring_candidates(plan: TilePlan, spec: ModelSpec, batch: int, gpu: GpuSpec,
                    slot_sizes: tuple[int, ...] = SLOT_SIZES) -> list[TilePlan]:
    """Every (stages, slot_bytes) that fits with the rest of ``plan``."""
    out = []
    for slot in slot_sizes:
        for st in STAGES:
            p = replace(plan, stages=st, slot_bytes=slot)
            if valid(p, spec, batch, gpu):
                out.append(p)
    return out


# Plan families the report compares (Ada-MK's K-split claim): a predicate per family.
def no_ksplit(plan: TilePlan, spec: ModelSpec) -> bool:
    """No task is split along K (each GEMV task reduces over its whole K range)."""
    return plan.o_ksplit == 1 and plan.down_ksplit == 1


def no_k_tiling(plan: TilePlan, spec: ModelSpec) -> bool:
    """No K-splitting of any kind: no task K-split and every weight row fits one ring slot (the
    kernel never streams a row in pieces), i.e. K tile = K for every GEMV kind."""
    if not no_ksplit(plan, spec):
        return False
    try:
        return all(g.pieces == 1 for g in geometries(spec, plan).values())
    except ValueError:
        return False


def whole_row_slot_sizes(spec: ModelSpec) -> tuple[int, ...]:
    """Slot sizes at which no row of any GEMV kind (without task K-split) travels in pieces: one and
    two 16-row tensor-core blocks of the widest row (gate + up rows count twice). At 8B widths these
    exceed every GPU's per-block shared memory: the no-K-tiling family is then evaluated unbounded."""
    widest = max(MMA_ROWS * pair * k * 2 for k, pair in gemv_k_ranges(spec, TilePlan(o_ksplit=1, down_ksplit=1)).values())
    return (widest, 2 * widest)


def largest_ring(plan: TilePlan, spec: ModelSpec, batch: int, gpu: GpuSpec, admit=None,
                 slot_sizes: tuple[int, ...] = SLOT_SIZES) -> TilePlan | None:
    """The fitting (stages, slot) with the most ring bytes (then the smaller slot) that ``admit`` accepts."""
    cands = [p for p in ring_candidates(plan, spec, batch, gpu, slot_sizes) if admit is None or admit(p, spec)]
    if not cands:
        return None
    return max(cands, key=lambda p: (p.stages * p.slot_bytes, -p.slot_bytes))


def with_ksplit(plan: TilePlan, field: str, k: int, spec: ModelSpec, num_sms: int, batch: int) -> TilePlan:
    """Change a K-split factor and rescale that kind's rows to keep the same number of waves."""
    H = spec.hidden_size
    if field == "o_ksplit":
        n = oproj_rows(spec, plan)
        waves = max(1, round(-(-n // plan.o_rows) * plan.o_ksplit / num_sms))
        rows = min(wave_rows(n, k, num_sms, unit=row_unit(spec)), key=lambda r: abs(-(-n // r) * k / num_sms - waves))
        return replace(plan, o_ksplit=k, o_rows=rows)
    c = mlp_copies(spec, batch)
    waves = max(1, round(-(-H // plan.down_rows) * plan.down_ksplit * c / num_sms))
    rows = min(wave_rows(H, k, num_sms, unit=row_unit(spec), copies=c),
               key=lambda r: abs(-(-H // r) * k * c / num_sms - waves))
    return replace(plan, down_ksplit=k, down_rows=rows)


def wide_ring_plan(spec: ModelSpec, batch: int, gpu: GpuSpec, num_sms: int, context_len: int,
                   slot_sizes: tuple[int, ...] = SLOT_SIZES) -> TilePlan | None:
    """A second starting point of the descent: the initial plan with the largest K-splits (smallest
    activations) and then the largest ring that fits. Where the ring decides the step (long contexts,
    whose attention chunks ride the ring; large batches, whose whole-K activations crowd it out), the
    descent from the initial plan can stall before it reaches such rings one field at a time."""
    p = initial_plan(spec, batch, gpu, num_sms, context_len, slot_sizes)
    o_ks, d_ks = ksplit_candidates(spec)
    p = with_ksplit(with_ksplit(p, "o_ksplit", max(o_ks), spec, num_sms, batch), "down_ksplit", max(d_ks), spec, num_sms,
                    batch)
    return largest_ring(p, spec, batch, gpu, slot_sizes=slot_sizes)


def with_weight_inflight(spec: ModelSpec, plan: TilePlan) -> TilePlan:
    """``plan`` with the ring slots in flight its weight format wants: the cap counts slots, and a
    4-bit slot carries about a quarter of a bf16 slot's bytes, so quantized weights keep twice the
    slots in flight (benchmarks/NOTES.md, 4-bit slots in flight). The search does not vary these fields."""
    if not spec.quantized:
        return plan
    return replace(plan, inflight_slots=QUANTIZED_INFLIGHT, inflight_chain=QUANTIZED_INFLIGHT)


def initial_plan(spec: ModelSpec, batch: int, gpu: GpuSpec, num_sms: int, context_len: int,
                 slot_sizes: tuple[int, ...] = SLOT_SIZES) -> TilePlan:
    """About four tasks per SM per GEMV kind, enough KV splits to give attention half the SMs, and
    the largest ring that leaves half of shared memory free (the search moves from here)."""
    def pick(cands: list[int], waves: int) -> int:
        return cands[min(waves, len(cands)) - 1]

    gr = (spec.group_size + 2) * spec.head_dim
    splits = attn_split_candidates(spec, num_sms, context_len)
    s = next((x for x in splits if spec.num_kv_heads * x >= num_sms // 2), splits[-1])
    o_ks, d_ks = smallest_fitting_ksplit(spec, batch, gpu)
    u, c = row_unit(spec), mlp_copies(spec, batch)
    plan = TilePlan(qkv_rows=pick(wave_rows(spec.num_kv_heads * gr, 1, num_sms, cap=gr, unit=u), 4),
                    o_rows=pick(wave_rows(spec.hidden_size, o_ks, num_sms, unit=u), 4), o_ksplit=o_ks,
                    gateup_rows=pick(wave_rows(spec.mlp_intermediate, 1, num_sms, unit=u, copies=c), 4),
                    down_rows=pick(wave_rows(spec.hidden_size, d_ks, num_sms, unit=u, copies=c), 4), down_ksplit=d_ks,
                    lm_rows=pick(wave_rows(spec.vocab_size, 1, num_sms, max_waves=LM_MAX_WAVES), 8),
                    attn_splits=s, stages=2, slot_bytes=4096, consumer_warps=8)
    plan = with_weight_inflight(spec, plan)
    rings = ring_candidates(plan, spec, batch, gpu, slot_sizes)
    if not rings:
        raise ValueError(f"no tile plan fits {gpu.name}'s shared memory at batch {batch}")
    roomy = [p for p in rings if plan_smem(spec, batch, p).peak <= gpu.smem_per_block_optin // 2]
    if not roomy:
        return min(rings, key=lambda p: plan_smem(spec, batch, p).peak)
    return max(roomy, key=lambda p: (p.stages * p.slot_bytes, -p.slot_bytes))
