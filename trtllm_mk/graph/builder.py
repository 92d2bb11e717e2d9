"""Lower one decode step of a ModelSpec at batch B into tiled tasks and event tensors.

Event granularity per edge follows producer and consumer partitions:
  resid_ready [L+1, 1]  whole residual vector: every norm-prologue task (QKV, GATEUP via oproj_done,
                        LMHEAD) reads all of x; row 0 is signalled by EMBED, row l+1 by layer l's DOWN.
  qkv_done    [L, nkv]  per KV group: attention of group g starts when group g's q/k/v rows are done
                        (polled: ATTN loads QKV's tagged words).
  qkv_all     [L, 1]    only with an OPROJ K-split: every QKV tile has read x (which OPROJ adds into);
                        a staged signal (Task.staged_signals, published once the tile has staged x:
                        kinds/qkv.py).
  attn_done   [L, nkv]  per KV group: the S split partials of group g ([L, o_ksplit] per OPROJ K-chunk
                        with o_merge: OPROJ merges the partials of its chunk's groups itself).
  combine_done[L, o_ksplit] per OPROJ K-chunk: an OPROJ chunk starts when its heads are combined
                        (absent with o_merge).
  oproj_done  [L, 1]    whole: GATEUP's norm reads all of x.
  gateup_done [L, down_ksplit] per DOWN K-chunk (kinds/gateup.py down_chunks; polled: DOWN loads its
                        chunk's tagged act words). DOWN adds into x, which every GATEUP tile of the
                        layer reads for its norm, so a K-split DOWN also waits on
  gateup_staged [L, 1]  every GATEUP tile has staged x: a staged signal guarding x (cross-rank under
                        tensor parallelism).
  lm_done     [1, 1]    ARGMAX reduces every LM-head tile.
On one GPU a dense step's residual is counted (trtllm_mk/residual.py, counted_residual below): every add
into x also counts in the word, and resid_ready and oproj_done are polled: QKV, GATEUP and LMHEAD stage x
once every word holds their layer's count, and OPROJ, DOWN and EMBED release nothing for them.
Mixture-of-experts layers (model.families MOE_STEP) replace GATEUP / DOWN (by EMLP tasks under
TilePlan.expert_fused, which wait for oproj_done only and signal resid_ready; then neither route_done
nor egateup_done exists, and ROUTER runs at the layer's start: kinds/router.py):
  router_done [L, 1]    every router logit and the normed rows moe_xn are published: ROUTE, EGATEUP
                        and the loaders of EGATEUP / EDOWN (which route the rows themselves) wait for it.
                        Under expert_fused: the logits' first share is in router_acc and x is read, so
                        OPROJ, which adds into both, waits for it.
  route_done  [L, 1]    ROUTE has written the slots' routing weights, which EDOWN scales by.
  egateup_done[L, NSLOT] per expert slot: EDOWN of slot s reads slot s's activation; no EGATEUP task
                        reads x (they stage moe_xn), so EDOWN's adds need not wait for the other slots.

Tensor parallelism (ModelSpec.tensor_parallel > 1: the spec is one rank's share, parallel/layout.py).
Every rank holds the whole residual x. OPROJ and DOWN add their partial sums into every rank's x (the
all-reduce, fused into the GEMVs: fixed-point adds give the same bits in any order), EMBED writes the
rows of the tokens in its vocabulary range into every rank's x, and LMHEAD publishes its tile's maximum
into every rank's lm_val / lm_idx (ARGMAX then reduces all ranks' tiles). The events that order these
cross-rank writes are CROSS_RANK_EVENTS: each rank's task signals every rank's counter, and a wait
needs the signals of all ranks. resid_ready, oproj_done and lm_done carry the data (all ranks' adds or
maxima have landed); qkv_all and gateup_staged guard x against a peer's adds while this rank's QKV or
GATEUP tiles still read it for their norm, so under tensor parallelism every OPROJ waits on qkv_all.
A rank cannot run ahead into the next step's writes: its step ends after lm_done, which needs every
rank's LM-head tiles, and those read x last.
"""
from __future__ import annotations

from itertools import accumulate

from ..errors import ModelError
from ..model.families import FAMILIES
from ..model.spec import ModelSpec
from .tasks import HEAD, KV_RUNS, LAYER, MAX_BATCH, TAIL, Access, Dims, Event, EventRef, Kind, StepGraph, Task, TilePlan


# events signalled by every rank on every rank under tensor parallelism (module docstring)
CROSS_RANK_EVENTS = frozenset({"resid_ready", "oproj_done", "qkv_all", "gateup_staged", "lm_done"})


# the events that say x is ready for its next reader: polled under a counted residual
RESIDUAL_EVENTS = frozenset({"resid_ready", "oproj_done"})


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + size)) for i in range(0, n, size)]


# ROUTE holds a row's router logits one per consumer thread of a warp's lanes (device route.cuh)
MAX_EXPERTS = 256
MAX_EXPERTS_PER_TOKEN = 8


def check_model_supported(spec: ModelSpec) -> None:
    """Shape constraints of the megakernel's task graph (16-byte vectors, 8-row ring stages, 64-column
    K-chunks) and the mixture-of-experts layouts it implements."""
    H, I, V = spec.hidden_size, spec.mlp_intermediate, spec.vocab_size
    width = "moe_intermediate_size" if spec.is_moe else "intermediate_size"
    for name, val, mult in (("hidden_size", H, 64), (width, I, 64), ("vocab_size", V, 8),
                            ("num_heads*head_dim", spec.q_size, 64)):
        if val % mult:
            raise ModelError(f"{spec.name}: {name}={val} must be a multiple of {mult} for the megakernel")
    if spec.is_moe:
        check_moe_supported(spec)


def check_kernel_supported(spec: ModelSpec) -> None:
    """What the generated kernel adds to the graph's constraints: a warp's 32 lanes split every head."""
    check_model_supported(spec)
    if spec.head_dim % 32:
        raise ModelError(f"{spec.name}: head_dim={spec.head_dim} must be a multiple of 32 for the megakernel")


def check_moe_supported(spec: ModelSpec) -> None:
    """The megakernel's expert kinds run models whose every layer is sparse, with bf16 weights on one
    GPU, at most MAX_EXPERTS experts and MAX_EXPERTS_PER_TOKEN per token: anything else one line."""
    dense = [i for i in range(spec.num_layers) if not spec.is_moe_layer(i)]
    why = None
    if dense:
        why = (f"dense MLP layers {dense} (mlp_only_layers / decoder_sparse_step); the megakernel runs "
               "models whose every layer routes to experts")
    elif spec.num_experts > MAX_EXPERTS or spec.num_experts_per_tok > MAX_EXPERTS_PER_TOKEN:
        why = (f"{spec.num_experts} experts, {spec.num_experts_per_tok} per token; the megakernel routes at most "
               f"{MAX_EXPERTS} experts and {MAX_EXPERTS_PER_TOKEN} per token")
    elif spec.quantized:
        why = "quantized expert weights; the megakernel streams bf16 experts"
    elif spec.tensor_parallel > 1:
        why = "tensor parallelism; the megakernel runs a mixture-of-experts model on one GPU"
    if why:
        raise ModelError(f"{spec.name}: a mixture-of-experts model with {why}")


def check_plan(spec: ModelSpec, plan: TilePlan, batch: int = 1) -> None:
    """Reject tile plans the kernel cannot execute at ``batch`` (programming errors: plans come from the
    search)."""
    for f in ("qkv_rows", "o_rows", "gateup_rows", "down_rows", "lm_rows"):
        v = getattr(plan, f)
        if v <= 0 or v % 8:
            raise ValueError(f"TilePlan.{f}={v} must be a positive multiple of 8")
    if plan.o_ksplit < 1 or spec.num_kv_heads % plan.o_ksplit:
        raise ValueError(f"TilePlan.o_ksplit={plan.o_ksplit} must divide num_kv_heads={spec.num_kv_heads}")
    if plan.down_ksplit < 1 or spec.mlp_intermediate % (64 * plan.down_ksplit):
        raise ValueError(f"TilePlan.down_ksplit={plan.down_ksplit}: the MLP width "
                         f"{spec.mlp_intermediate} must split into multiples of 64 columns")
    if plan.attn_splits < 1:
        raise ValueError("TilePlan.attn_splits must be >= 1")
    if plan.attn_rows < 0:
        raise ValueError("TilePlan.attn_rows must be >= 0 (0: every batch row in one ATTN task)")
    if plan.attn_kv_run not in KV_RUNS:
        raise ValueError(f"TilePlan.attn_kv_run={plan.attn_kv_run} must be one of {', '.join(map(str, KV_RUNS))}")
    if spec.quantized:
        # 4-bit weights travel in tiles of 16 rows with their scale words, and a task's K range holds
        # whole tiles and groups
        for f in ("qkv_rows", "o_rows", "gateup_rows", "down_rows"):
            if getattr(plan, f) % 16:
                raise ValueError(f"TilePlan.{f}={getattr(plan, f)} must be a multiple of 16 for quantized weights")
        unit = max(spec.weight_group, tile_cols(spec))
        for what, k in (("hidden_size", spec.hidden_size), ("q_size / o_ksplit", spec.q_size // plan.o_ksplit),
                        ("intermediate_size / down_ksplit", spec.mlp_intermediate // plan.down_ksplit)):
            if k % unit:
                raise ValueError(f"TilePlan: {what} = {k} is not a whole number of {unit}-column weight tiles")
    if plan.expert_fused:
        from ..kinds import emlp
        why = "a dense model has no experts" if not spec.is_moe else emlp.check(spec, plan, batch)
        if why:
            raise ValueError(f"TilePlan.expert_fused: {why}")
    if not 0 <= plan.expert_inflight <= plan.stages:
        raise ValueError(f"TilePlan: need 0 <= expert_inflight ({plan.expert_inflight}) <= stages ({plan.stages})")
    if not 1 <= plan.inflight_chain <= plan.inflight_slots:
        raise ValueError(f"TilePlan: need 1 <= inflight_chain ({plan.inflight_chain}) <= inflight_slots "
                         f"({plan.inflight_slots})")


def tile_cols(spec: ModelSpec) -> int:
    from ..quant.kernel_layout import tile_cols as cols
    return cols(spec)


class Lowering:
    """What a kind's ``lower`` reads: the shapes of the model at the batch and the tile plan."""

    def __init__(self, spec: ModelSpec, batch: int, plan: TilePlan, context_len: int):
        self.spec, self.plan, self.context_len = spec, plan, context_len
        self.B, self.L = batch, spec.num_layers
        self.H, self.I, self.V = spec.hidden_size, spec.mlp_intermediate, spec.vocab_size
        # mixture of experts: E experts, k per token, NSLOT expert slots per step (kinds/route.py)
        self.E, self.k, self.NSLOT = spec.num_experts, spec.num_experts_per_tok, spec.moe_slots(batch)
        self.nh, self.nkv, self.d, self.G = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group_size
        self.S = plan.attn_splits
        self.wb = spec.dtype_bytes
        self.linear_bytes = spec.linear_bytes   # a decoder layer's weight tile as streamed (quantized or not)
        self.GR = (self.G + 2) * self.d      # qkv rows per KV group
        self.QKVR = self.nkv * self.GR
        self.QD = self.nh * self.d
        self.groups_per_chunk = self.nkv // plan.o_ksplit   # KV groups per OPROJ K-chunk
        self.lm_tiles = _tiles(self.V, plan.lm_rows)
        self.tp = spec.tensor_parallel   # ranks sharing the model (module docstring)

    tiles = staticmethod(_tiles)

    def partials(self, g0: int, g1: int) -> tuple[Access, Access]:
        """The S split partials of KV groups [g0, g1)."""
        S, G, d = self.S, self.G, self.d
        return (Access("part_o", g0 * S * G * d, g1 * S * G * d), Access("part_ml", g0 * S * G * 2, g1 * S * G * 2))


def derive_events(head: list[Task], layer: list[Task], tail: list[Task], num_layers: int,
                  tensor_parallel: int = 1, counted: bool = False) -> dict[str, Event]:
    """Event tensors from the tasks' signals: a slot's count is how many tasks of one rank signal it
    per step (a LAYER task's relative row ``i`` is row ``layer + i`` of every layer). An event that a
    LAYER task signals or waits on has a row per layer (plus the rows its relative indices reach); the
    others have as many rows as their references reach. With ``tensor_parallel`` > 1 the events of
    CROSS_RANK_EVENTS are marked cross-rank. An event whose signalling kinds store it as tagged data
    (KindDef.signals_by_data) is polled: every kind that signals it must, and every kind that waits
    for it must poll it (KindDef.polls); RESIDUAL_EVENTS only under a ``counted`` residual."""
    L = num_layers
    refs: dict[str, list[tuple[str, EventRef]]] = {}
    for phase, tasks in ((HEAD, head), (LAYER, layer), (TAIL, tail)):
        for t in tasks:
            for r in t.waits + t.signals:
                refs.setdefault(r.event, []).append((phase, r))
    events = {}
    for name in sorted(refs):
        per_layer = any(phase == LAYER for phase, _ in refs[name])
        rows = max((L + r.index if phase == LAYER else r.index + 1) for phase, r in refs[name])
        slots = max(r.slot for _, r in refs[name]) + 1
        counts = [[0] * slots for _ in range(rows)]
        for phase, tasks in ((HEAD, head), (LAYER, layer), (TAIL, tail)):
            for t in tasks:
                for r in t.signals:
                    if r.event != name:
                        continue
                    for row in ([layer_i + r.index for layer_i in range(L)] if phase == LAYER else [r.index]):
                        counts[row][r.slot] += 1
        events[name] = Event(name, rows, slots, tuple(tuple(c) for c in counts), per_layer,
                             cross_rank=tensor_parallel > 1 and name in CROSS_RANK_EVENTS,
                             polled=_polled(name, head + layer + tail, counted))
    return events


def _polled(name: str, tasks: list[Task], counted: bool = False) -> bool:
    """Whether event ``name`` is carried by tagged data (derive_events); a mix is a kind-definition error."""
    if name in RESIDUAL_EVENTS and not counted:
        return False
    by_data = {t.kind.definition.name: name in t.kind.definition.signals_by_data
               for t in tasks if any(r.event == name for r in t.signals)}
    if len(set(by_data.values())) > 1:
        raise ValueError(f"event {name}: signalled by tagged data in some kinds and not in others ({by_data})")
    polled = any(by_data.values())
    if polled:
        deaf = sorted({t.kind.definition.name for t in tasks if any(r.event == name for r in t.waits)
                       and name not in t.kind.definition.polls})
        if deaf:
            raise ValueError(f"event {name} is carried by tagged data, but kinds {deaf} wait for it without polling it")
    return polled


def counted_residual(tasks: list[Task], layer: list[Task], hidden: int, num_layers: int,
                     tensor_parallel: int) -> tuple[int, int]:
    """(adds into each element of x a layer makes before oproj_done, adds a layer makes), or (0, 0)
    where x is not counted. It is counted on one GPU when every kind that signals a RESIDUAL_EVENT
    stores x's words itself and every kind that waits for one polls them (KindDef.signals_by_data /
    polls: a dense step; an expert kind adds only where its routing says), every element takes the
    same number of adds, and a step's counts fit the word (residual.fits_counts)."""
    from ..residual import fits_counts
    if tensor_parallel != 1:
        return 0, 0
    for t in tasks:
        d = t.kind.definition
        if any(r.event in RESIDUAL_EVENTS and r.event not in d.signals_by_data for r in t.signals) or \
                any(r.event in RESIDUAL_EVENTS and r.event not in d.polls for r in t.waits):
            return 0, 0

    def adds(ts: list[Task]) -> int:   # adds into every element, or -1 where elements differ
        n = [0] * (hidden + 1)
        for t in ts:
            for w in t.writes:
                if w.buf == "x":
                    if w.rows is not None:   # some batch rows only
                        return -1
                    n[w.lo] += 1
                    n[w.hi] -= 1
        per = set(accumulate(n[:hidden]))
        return per.pop() if len(per) == 1 else -1

    o_adds = adds([t for t in layer if any(r.event == "oproj_done" for r in t.signals)])
    all_adds = adds(layer)
    if o_adds < 0 or all_adds <= 0 or not fits_counts(num_layers, all_adds):
        return 0, 0
    return o_adds, all_adds


def _dependency_order(lowered: list[tuple[Kind, list[dict]]]) -> list[tuple[Kind, list[dict]]]:
    """The family's kind order, except that a kind whose tasks wait for an event of the same row (the
    same layer) comes after the kinds that signal it: the task list is then a topological order, which
    the list scheduler keeps on every SM (search/listsched.py). The plan may move a kind's place in the
    step (kinds/router.py: under TilePlan.expert_fused ROUTER runs at the layer's start)."""
    signals = [{(r.event, r.slot) for kw in kws for r in kw.get("signals", ()) if r.index == 0} for _, kws in lowered]
    waits = [{(r.event, r.slot) for kw in kws for r in kw.get("waits", ()) if r.index == 0} for _, kws in lowered]
    after = [{j for j in range(len(lowered)) if j != i and waits[i] & signals[j]} for i in range(len(lowered))]
    order, left = [], list(range(len(lowered)))
    while left:
        i = next((i for i in left if after[i] <= set(order)), None)
        if i is None:
            raise ValueError("the step's kinds wait for each other's events in a cycle: "
                             + ", ".join(lowered[i][0].name for i in left))
        order.append(i)
        left.remove(i)
    return [lowered[i] for i in order]


def build_step_graph(spec: ModelSpec, batch: int, plan: TilePlan, context_len: int = 512) -> StepGraph:
    """The task graph of one decode step: each kind of the family's step lowers itself into tasks
    (trtllm_mk.kinds, model.families); the event tensors follow from the tasks' signals. ``context_len`` only feeds
    the cost estimates of ATTN."""
    check_model_supported(spec)
    check_plan(spec, plan, batch)
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch {batch}: the megakernel decodes 1 to {MAX_BATCH} sequences per step")
    c = Lowering(spec, batch, plan, context_len)
    phases: dict[str, list[Task]] = {}
    for phase, kind_names in FAMILIES[spec.family].step:   # the family composes the kinds
        lowered = [(kind, kind.module.lower(c)) for kind in (Kind[n] for n in kind_names if Kind[n].active(spec, plan))]
        tasks: list[Task] = []
        for kind, kws in _dependency_order(lowered):
            for kw in kws:
                tasks.append(Task(kind=kind, phase=phase, index=len(tasks), **kw))
        phases[phase] = tasks
    head, layer, tail = phases[HEAD], phases[LAYER], phases[TAIL]
    o_adds, layer_adds = counted_residual(head + layer + tail, layer, c.H, c.L, c.tp)
    events = derive_events(head, layer, tail, c.L, c.tp, counted=layer_adds > 0)
    dims = Dims(batch=c.B, layers=c.L, hidden=c.H, intermediate=c.I, vocab=c.V, heads=c.nh, kv_heads=c.nkv,
                head_dim=c.d, group=c.G, splits=c.S, group_rows=c.GR, qkv_rows=c.QKVR, q_dim=c.QD,
                n_lm_tiles=len(c.lm_tiles), context_len=context_len, weight_bits=spec.weight_bits,
                weight_group=spec.weight_group, weight_tile=tile_cols(spec) if spec.quantized else 0,
                tensor_parallel=c.tp, experts=c.E, experts_per_token=c.k, expert_slots=c.NSLOT,
                resid_o_adds=o_adds, resid_layer_adds=layer_adds)
    return StepGraph(num_layers=c.L, batch=c.B, plan=plan, head=head, layer=layer, tail=tail,
                     events=events, dims=dims)
