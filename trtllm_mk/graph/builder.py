"""Lower one decode step of a ModelSpec at batch B into tiled tasks and event tensors.

Event granularity per edge follows producer and consumer partitions:
  resid_ready [L+1, 1]  whole residual vector: every norm-prologue task (QKV, GATEUP via oproj_done,
                        LMHEAD) reads all of x; row 0 is signalled by EMBED, row l+1 by layer l's DOWN.
  qkv_done    [L, nkv]  per KV group: attention of group g starts when group g's q/k/v rows are done.
  qkv_all     [L, 1]    only with an OPROJ K-split: every QKV tile (they read x, which OPROJ adds into).
  attn_done   [L, nkv]  per KV group: the S split partials of group g ([L, o_ksplit] per OPROJ K-chunk
                        with o_merge: OPROJ merges the partials of its chunk's groups itself).
  combine_done[L, o_ksplit] per OPROJ K-chunk: an OPROJ chunk starts when its heads are combined
                        (absent with o_merge).
  oproj_done  [L, 1]    whole: GATEUP's norm reads all of x.
  gateup_done [L, 1]    whole, not per K-chunk: DOWN adds into x, which GATEUP tasks of the same layer
                        read for their norm, so DOWN must wait for all of them (the race checker
                        rejects the per-chunk variant).
  lm_done     [1, 1]    ARGMAX reduces every LM-head tile.
"""
from __future__ import annotations

from ..errors import ModelError
from ..model.spec import ModelSpec
from .tasks import HEAD, LAYER, MAX_BATCH, TAIL, Access, Dims, Event, EventRef, Kind, StepGraph, Task, TilePlan


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + size)) for i in range(0, n, size)]


def check_model_supported(spec: ModelSpec) -> None:
    """Shape constraints of the megakernel (16-byte vectors, 8-row ring stages, 64-column K-chunks)."""
    H, I, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    for name, val, mult in (("hidden_size", H, 64), ("intermediate_size", I, 64), ("vocab_size", V, 8),
                            ("num_heads*head_dim", spec.q_size, 64)):
        if val % mult:
            raise ModelError(f"{spec.name}: {name}={val} must be a multiple of {mult} for the megakernel")


def check_plan(spec: ModelSpec, plan: TilePlan) -> None:
    """Reject tile plans the kernel cannot execute (programming errors: plans come from the search)."""
    for f in ("qkv_rows", "o_rows", "gateup_rows", "down_rows", "lm_rows"):
        v = getattr(plan, f)
        if v <= 0 or v % 8:
            raise ValueError(f"TilePlan.{f}={v} must be a positive multiple of 8")
    if plan.o_ksplit < 1 or spec.num_kv_heads % plan.o_ksplit:
        raise ValueError(f"TilePlan.o_ksplit={plan.o_ksplit} must divide num_kv_heads={spec.num_kv_heads}")
    if plan.down_ksplit < 1 or spec.intermediate_size % (64 * plan.down_ksplit):
        raise ValueError(f"TilePlan.down_ksplit={plan.down_ksplit}: intermediate_size "
                         f"{spec.intermediate_size} must split into multiples of 64 columns")
    if plan.attn_splits < 1:
        raise ValueError("TilePlan.attn_splits must be >= 1")
    if not 1 <= plan.inflight_chain <= plan.inflight_slots:
        raise ValueError(f"TilePlan: need 1 <= inflight_chain ({plan.inflight_chain}) <= inflight_slots "
                         f"({plan.inflight_slots})")


def build_step_graph(spec: ModelSpec, batch: int, plan: TilePlan, context_len: int = 512) -> StepGraph:
    """The task graph of one decode step. ``context_len`` only feeds the cost estimates of ATTN."""
    check_model_supported(spec)
    check_plan(spec, plan)
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch {batch}: the megakernel decodes 1 to {MAX_BATCH} sequences per step")
    B, L = batch, spec.num_layers
    H, I, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    nh, nkv, d, G = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group_size
    S = plan.attn_splits
    wb = spec.dtype_bytes
    GR = (G + 2) * d                      # qkv rows per KV group
    QKVR = nkv * GR
    QD = nh * d

    # ---------------- head: embedding lookup ------------------------------------------------
    erows = plan.embed_rows or 1024
    head = [Task(Kind.EMBED, HEAD, i, r0=a, r1=b,
                 signals=(EventRef("resid_ready", 0, 0),),
                 reads=(Access("tokens", 0, 1),), writes=(Access("x", a, b),),
                 act_bytes=B * (b - a) * (wb + 4))
            for i, (a, b) in enumerate(_tiles(H, erows))]

    layer: list[Task] = []

    def add(**kw) -> None:
        layer.append(Task(phase=LAYER, index=len(layer), **kw))

    # ---------------- QKV (norm + projection); q/k-norm and RoPE happen in ATTN -------------
    qkv_tiles = _tiles(QKVR, plan.qkv_rows)
    qkv_counts = [0] * nkv
    for a, b in qkv_tiles:
        groups = range(a // GR, (b - 1) // GR + 1)
        for g in groups:
            qkv_counts[g] += 1
        # With a K-split OPROJ, a chunk may add into x as soon as its own heads are combined, while
        # QKV tiles of other groups still read x for their norm: qkv_all orders every OPROJ after
        # every QKV (without K-split the single combine_done slot already implies it).
        all_sig = (EventRef("qkv_all", 0, 0),) if plan.o_ksplit > 1 else ()
        add(kind=Kind.QKV, r0=a, r1=b, k0=0, k1=H,
            waits=(EventRef("resid_ready", 0, 0),),
            signals=tuple(EventRef("qkv_done", 0, g) for g in groups) + all_sig,
            reads=(Access("x", 0, H),), writes=(Access("qkv", a, b),),
            weight_bytes=(b - a) * H * wb, act_bytes=B * (H * 4 + (b - a) * 4), flops=2 * B * (b - a) * H)

    # ---------------- split-KV attention and combine, per KV group ---------------------------
    ctx_chunk = -(-context_len // S)
    o_chunk = QD // plan.o_ksplit
    groups_per_chunk = nkv // plan.o_ksplit
    for g in range(nkv):
        for s in range(S):
            part = (g * S + s) * G
            done = EventRef("attn_done", 0, g // groups_per_chunk if plan.o_merge else g)
            add(kind=Kind.ATTN, group=g, split=s,
                waits=(EventRef("qkv_done", 0, g),), signals=(done,),
                reads=(Access("qkv", g * GR, (g + 1) * GR), Access("pos", 0, 1),
                       Access("kv", g * S + s, g * S + s + 1, layer=0)),
                writes=(Access("kv", g * S + s, g * S + s + 1, layer=0),
                        Access("part_o", part * d, (part + G) * d), Access("part_ml", part * 2, (part + G) * 2)),
                act_bytes=B * (ctx_chunk * 2 * d * 2 + GR * 4 + G * (d + 2) * 4),
                flops=4 * B * ctx_chunk * G * d)

    def partials(g0: int, g1: int) -> tuple[Access, Access]:   # the S split partials of groups [g0, g1)
        return (Access("part_o", g0 * S * G * d, g1 * S * G * d), Access("part_ml", g0 * S * G * 2, g1 * S * G * 2))

    if not plan.o_merge:
        for g in range(nkv):
            add(kind=Kind.COMBINE, group=g,
                waits=(EventRef("attn_done", 0, g),), signals=(EventRef("combine_done", 0, g // groups_per_chunk),),
                reads=partials(g, g + 1), writes=(Access("attn_out", g * G * d, (g + 1) * G * d),),
                act_bytes=B * (S * G * (d + 2) * 4 + G * d * 4), flops=3 * B * S * G * d)

    # ---------------- O projection + residual (optionally K-split by head groups) -----------
    o_tiles = _tiles(H, plan.o_rows)
    for a, b in o_tiles:
        for c in range(plan.o_ksplit):
            k0, k1 = c * o_chunk, (c + 1) * o_chunk
            split = plan.o_ksplit > 1
            if plan.o_merge:   # the chunk's heads merged from the split partials while staging
                ready = EventRef("attn_done", 0, c)
                source = partials(c * groups_per_chunk, (c + 1) * groups_per_chunk)
                staged = S * (k1 - k0) // d * (d + 2) * 4
            else:
                ready, source, staged = EventRef("combine_done", 0, c), (Access("attn_out", k0, k1),), (k1 - k0) * 4
            # qkv_all first: it is long satisfied when the task starts waiting, so its round trip
            # overlaps the wait for the chunk's heads instead of following it on the chain
            add(kind=Kind.OPROJ, r0=a, r1=b, k0=k0, k1=k1,
                waits=((EventRef("qkv_all", 0, 0),) if split else ()) + (ready,),
                signals=(EventRef("oproj_done", 0, 0),),
                reads=source + (() if split else (Access("x", a, b),)),
                writes=(Access("x", a, b, add=split),),
                weight_bytes=(b - a) * (k1 - k0) * wb, act_bytes=B * (staged + (b - a) * 8),
                flops=2 * B * (b - a) * (k1 - k0))

    # ---------------- norm + gate/up + SiLU*mul ---------------------------------------------
    gu_tiles = _tiles(I, plan.gateup_rows)
    for a, b in gu_tiles:
        add(kind=Kind.GATEUP, r0=a, r1=b, k0=0, k1=H,
            waits=(EventRef("oproj_done", 0, 0),), signals=(EventRef("gateup_done", 0, 0),),
            reads=(Access("x", 0, H),), writes=(Access("act", a, b),),
            weight_bytes=2 * (b - a) * H * wb, act_bytes=B * (H * 4 + (b - a) * 4), flops=4 * B * (b - a) * H)

    # ---------------- down + residual (optionally K-split) ----------------------------------
    d_tiles = _tiles(H, plan.down_rows)
    d_chunk = I // plan.down_ksplit
    for a, b in d_tiles:
        for c in range(plan.down_ksplit):
            k0, k1 = c * d_chunk, (c + 1) * d_chunk
            split = plan.down_ksplit > 1   # K-split partials accumulate atomically; otherwise read-modify-write
            add(kind=Kind.DOWN, r0=a, r1=b, k0=k0, k1=k1,
                waits=(EventRef("gateup_done", 0, 0),), signals=(EventRef("resid_ready", 1, 0),),
                reads=(Access("act", k0, k1),) + (() if split else (Access("x", a, b),)),
                writes=(Access("x", a, b, add=split),),
                weight_bytes=(b - a) * (k1 - k0) * wb, act_bytes=B * ((k1 - k0) * 4 + (b - a) * 8),
                flops=2 * B * (b - a) * (k1 - k0))

    # ---------------- tail: final norm + LM head + two-level argmax -------------------------
    lm_tiles = _tiles(V, plan.lm_rows)
    tail = [Task(Kind.LMHEAD, TAIL, i, r0=a, r1=b, k0=0, k1=H,
                 waits=(EventRef("resid_ready", L, 0),), signals=(EventRef("lm_done", 0, 0),),
                 reads=(Access("x", 0, H),), writes=(Access("logits", a, b), Access("lm_part", i, i + 1)),
                 weight_bytes=(b - a) * H * wb, act_bytes=B * (H * 4 + (b - a) * 4), flops=2 * B * (b - a) * H)
            for i, (a, b) in enumerate(lm_tiles)]
    tail.append(Task(Kind.ARGMAX, TAIL, len(tail), waits=(EventRef("lm_done", 0, 0),),
                     reads=(Access("lm_part", 0, len(lm_tiles)), Access("pos", 0, 1)),
                     writes=(Access("tokens", 0, 1), Access("history", 0, 1)),
                     act_bytes=B * len(lm_tiles) * 8))

    n_down = len(d_tiles) * plan.down_ksplit
    events = {
        "resid_ready": Event("resid_ready", L + 1, 1, ((len(head),),) + ((n_down,),) * L, True),
        "qkv_done": Event("qkv_done", L, nkv, (tuple(qkv_counts),) * L, True),
        "attn_done": (Event("attn_done", L, plan.o_ksplit, ((S * groups_per_chunk,) * plan.o_ksplit,) * L, True)
                      if plan.o_merge else Event("attn_done", L, nkv, ((S,) * nkv,) * L, True)),
        "oproj_done": Event("oproj_done", L, 1, ((len(o_tiles) * plan.o_ksplit,),) * L, True),
        "gateup_done": Event("gateup_done", L, 1, ((len(gu_tiles),),) * L, True),
        "lm_done": Event("lm_done", 1, 1, ((len(lm_tiles),),), False),
    }
    if not plan.o_merge:
        events["combine_done"] = Event("combine_done", L, plan.o_ksplit, ((groups_per_chunk,) * plan.o_ksplit,) * L,
                                       True)
    if plan.o_ksplit > 1:
        events["qkv_all"] = Event("qkv_all", L, 1, ((len(qkv_tiles),),) * L, True)
    dims = Dims(batch=B, layers=L, hidden=H, intermediate=I, vocab=V, heads=nh, kv_heads=nkv, head_dim=d, group=G,
                splits=S, group_rows=GR, qkv_rows=QKVR, q_dim=QD, n_lm_tiles=len(lm_tiles), context_len=context_len)
    return StepGraph(num_layers=L, batch=B, plan=plan, head=head, layer=layer, tail=tail,
                     events=events, dims=dims)
