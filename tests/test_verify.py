"""Schedule validator: hand-made bad schedules for every rejection class, and property tests that the
validator agrees with an independent brute-force checker and with the abstract machine."""
from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtllm_mk.executor import EventMachine
from trtllm_mk.graph import LAYER, Access, Event, EventRef, Kind, StepGraph, TilePlan, build_step_graph
from trtllm_mk.model.spec import ModelSpec
from trtllm_mk.schedule import Schedule, SMProgram
from trtllm_mk.verify import ScheduleError, check, validate


def tiny_spec(layers: int = 2, family: str = "llama") -> ModelSpec:
    return ModelSpec(name="tiny", family=family, hidden_size=64, intermediate_size=128, num_layers=layers,
                     num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)


def tp_share(layers: int = 2) -> ModelSpec:
    """One rank's share of a tiny model under tensor parallelism 2 (graph.builder: the guards of x
    are staged signals there)."""
    from trtllm_mk.parallel import rank_spec
    spec = ModelSpec(name="tiny-tp", family="llama", hidden_size=128, intermediate_size=256, num_layers=layers,
                     num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=128, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)
    return rank_spec(spec, 2)


TINY_PLAN = TilePlan(qkv_rows=48, o_rows=32, gateup_rows=64, down_rows=32, lm_rows=32, embed_rows=32,
                     attn_splits=2, down_ksplit=2)


def round_robin_schedule(spec: ModelSpec, plan: TilePlan, num_sms: int, batch: int = 1) -> Schedule:
    """Always legal: template order is topological and round-robin keeps it on every SM."""
    g = build_step_graph(spec, batch, plan)
    progs = [SMProgram() for _ in range(num_sms)]
    for phase, tasks in (("head", g.head), ("layer", g.layer), ("tail", g.tail)):
        for i in range(len(tasks)):
            getattr(progs[i % num_sms], phase).append(i)
    return Schedule(spec, batch, plan, num_sms, "test", progs)


def _same_layer_preds(tasks) -> list[set[int]]:
    """Template edges within one phase instance: a signals (e, i, s) and b waits (e, i, s)."""
    by_slot: dict = {}
    for t in tasks:
        for r in t.signals:
            by_slot.setdefault((r.event, r.index, r.slot), set()).add(t.index)
    return [set().union(*[by_slot.get((r.event, r.index, r.slot), set()) for r in t.waits]) for t in tasks]


def random_legal_schedule(spec: ModelSpec, plan: TilePlan, num_sms: int, rng: random.Random,
                          batch: int = 1) -> Schedule:
    """List scheduling: a random topological order of each phase, each task onto a random SM. Any
    such schedule is deadlock-free: one global order (layer, topological position) is consistent
    with every program and every edge (cross-layer edges only go to later layers)."""
    g = build_step_graph(spec, batch, plan)
    progs = [SMProgram() for _ in range(num_sms)]
    for phase, tasks in (("head", g.head), ("layer", g.layer), ("tail", g.tail)):
        preds = _same_layer_preds(tasks)
        done: set[int] = set()
        while len(done) < len(tasks):
            ready = [t.index for t in tasks if t.index not in done and preds[t.index] <= done]
            i = rng.choice(ready)
            done.add(i)
            getattr(progs[rng.randrange(num_sms)], phase).append(i)
    return Schedule(spec, batch, plan, num_sms, "test", progs)


# ----------------------------------------------------------------------------- brute force
def brute_force_verdict(sched: Schedule, g: StepGraph) -> str | None:
    """Independent, quadratic check: None if safe, else the first failing class. Explicit
    signaller->waiter edges (no junction nodes), DFS reachability, all access pairs."""
    if len(sched.programs) != sched.num_sms:
        return "structure"
    for phase, tasks in (("head", g.head), ("layer", g.layer), ("tail", g.tail)):
        idxs = [i for p in sched.programs for i in getattr(p, phase)]
        if sorted(idxs) != list(range(len(tasks))):
            return "structure"
    inst = [(sm, t, l) for sm in range(sched.num_sms) for t, l in sched.unrolled(sm, g)]
    for _, t, l in inst:
        for r in t.waits + t.signals:
            ev = g.events.get(r.event)
            _, row, slot = g.resolve(t, l, r)
            if ev is None or not (0 <= row < ev.rows and 0 <= slot < ev.slots):
                return "structure"
    per_slot: dict = {}
    for _, t, l in inst:
        for r in t.signals:
            per_slot[g.resolve(t, l, r)] = per_slot.get(g.resolve(t, l, r), 0) + 1
    for name, ev in g.events.items():
        for row in range(ev.rows):
            for slot in range(ev.slots):
                if per_slot.get((name, row, slot), 0) != ev.counts[row][slot]:
                    return "counts"
    # A task with staged signals is two steps: staging (its waits, staged reads, staged signals), then
    # the rest (its other accesses and signals). Each step: (sm, waits, signals, accesses, layer, task).
    steps = []
    for sm, t, l in inst:
        k = t.staged_signals
        reads = [(a, False) for a in t.reads]
        writes = [(a, True) for a in t.writes]
        if k:
            steps.append((sm, t.waits, t.signals[:k], [(a, w) for a, w in reads if a.staged], l, t))
            steps.append((sm, (), t.signals[k:], [(a, w) for a, w in reads if not a.staged] + writes, l, t))
        else:
            steps.append((sm, t.waits, t.signals, reads + writes, l, t))
    sig: dict = {}
    for k, (_, _, sigs, _, l, t) in enumerate(steps):
        for r in sigs:
            sig.setdefault(g.resolve(t, l, r), []).append(k)
    succ: list[set[int]] = [set() for _ in steps]
    for k, (_, waits, _, _, l, t) in enumerate(steps):
        for r in waits:
            for a in sig.get(g.resolve(t, l, r), []):
                succ[a].add(k)
    for a in range(len(steps) - 1):
        if steps[a][0] == steps[a + 1][0]:
            succ[a].add(a + 1)
    reach = []
    for s in range(len(steps)):
        seen, stack = set(), list(succ[s])
        while stack:
            x = stack.pop()
            if x not in seen:
                seen.add(x)
                stack.extend(succ[x])
        reach.append(seen)
    if any(k in reach[k] for k in range(len(steps))):
        return "deadlock"

    def accesses(step):
        _, _, _, accs, l, t = step
        for a, w in accs:
            lay = a.layer + l if (a.layer >= 0 and t.phase == LAYER) else a.layer
            yield a.buf, lay, a.lo, a.hi, w, a.add

    acc = [list(accesses(st)) for st in steps]
    for i in range(len(steps)):
        for j in range(i + 1, len(steps)):
            if j in reach[i] or i in reach[j]:
                continue
            for b1, l1, lo1, hi1, w1, a1 in acc[i]:
                for b2, l2, lo2, hi2, w2, a2 in acc[j]:
                    if (b1, l1) == (b2, l2) and max(lo1, lo2) < min(hi1, hi2) and (w1 or w2) \
                            and not (a1 and a2):
                        return "races"
    return None


def machine_completes(sched: Schedule, g: StepGraph, seeds: int = 4) -> bool:
    """Run the abstract machine under several interleavings, two steps each (monotonic counters)."""
    try:
        for mode in ("round_robin", "sequential"):
            m = EventMachine(sched, g)
            m.run(None, mode)
            m.run(None, mode)
        for seed in range(seeds):
            m = EventMachine(sched, g)
            m.run(None, "random", seed)
            m.run(None, "random", seed + 100)
    except ScheduleError:
        return False
    return True


# ----------------------------------------------------------------------------- hand-made cases
@pytest.fixture(scope="module")
def good():
    spec = tiny_spec()
    return round_robin_schedule(spec, TINY_PLAN, 3)


def _copy(sched: Schedule) -> Schedule:
    return dataclasses.replace(sched, programs=[SMProgram(list(p.head), list(p.layer), list(p.tail))
                                                for p in sched.programs])


def _graph_with(g: StepGraph, layer_tasks=None, events=None) -> StepGraph:
    return dataclasses.replace(g, layer=layer_tasks if layer_tasks is not None else list(g.layer),
                               events=events if events is not None else dict(g.events))


def test_good_schedule_is_accepted(good):
    rep = check(good)
    assert rep.ok and rep.tasks == good.graph().num_tasks() and rep.edges > rep.tasks
    assert rep.checked_pairs > 0 and "valid" in rep.summary()


def test_missing_task(good):
    s = _copy(good)
    dropped = s.programs[1].layer.pop(0)
    rep = validate(s)
    assert not rep.ok and rep.failed_check == "structure"
    assert f"layer task {dropped} " in rep.errors[0] and "scheduled on no SM" in rep.errors[0]
    with pytest.raises(ScheduleError, match="scheduled on no SM"):
        check(s)


def test_duplicated_task(good):
    s = _copy(good)
    s.programs[2].tail.append(s.programs[0].tail[0])
    rep = validate(s)
    assert rep.failed_check == "structure" and "scheduled 2 times" in rep.errors[0]


def test_index_out_of_range_and_program_count(good):
    s = _copy(good)
    s.programs[0].head.append(99)
    assert "out of range" in validate(s).errors[0]
    s = _copy(good)
    s.programs.append(SMProgram())
    assert "num_sms=3" in validate(s).errors[0]


def test_count_too_high_deadlocks(good):
    g = good.graph()
    ev = g.events["qkv_done"]
    counts = tuple(tuple(c + (1 if s == 1 else 0) for s, c in enumerate(row)) for row in ev.counts)
    g2 = _graph_with(g, events={**g.events, "qkv_done": dataclasses.replace(ev, counts=counts)})
    rep = validate(good, g2)
    assert rep.failed_check == "counts"
    assert "waits qkv_done[0][1] which can reach only 2 of 3 signals" in rep.errors[0]
    assert rep.errors[0].startswith("SM 0 task 3 (layer 0 ATTN[g1 s1 b0:1]) waits")


def test_count_too_low_is_a_race(good):
    g = good.graph()
    ev = g.events["gateup_done"]
    counts = tuple(tuple(c - 1 for c in row) for row in ev.counts)
    g2 = _graph_with(g, events={**g.events, "gateup_done": dataclasses.replace(ev, counts=counts)})
    rep = validate(good, g2)
    assert rep.failed_check == "counts" and "may pass before all its producers" in rep.errors[0]
    assert "DOWN" in rep.errors[0]


def test_cycle_across_two_sms():
    """SM0: ATTN of group 0, then QKV of group 1; SM1: ATTN of group 1, then QKV of group 0."""
    spec, plan = tiny_spec(1), dataclasses.replace(TINY_PLAN, qkv_rows=32)
    g = build_step_graph(spec, 1, plan)
    qkv = {gr: [t.index for t in g.layer if t.kind == Kind.QKV and t.r0 // 64 == gr] for gr in (0, 1)}
    attn = {gr: [t.index for t in g.layer if t.kind == Kind.ATTN and t.group == gr] for gr in (0, 1)}
    rest = [t.index for t in g.layer if t.kind not in (Kind.QKV, Kind.ATTN)]
    progs = [SMProgram([0, 1], attn[0] + qkv[1] + rest, [0, 1, 2]), SMProgram([], attn[1] + qkv[0], [])]
    s = Schedule(spec, 1, plan, 2, "test", progs)
    rep = validate(s)
    assert rep.failed_check == "deadlock"
    msg = rep.errors[0]
    assert "SM 0 task 2 (layer 0 ATTN[g0 s0 b0:1]) waits qkv_done[0][0] which can reach only 0 of 2" in msg
    assert "SM 1 task 0 (layer 0 ATTN[g1 s0 b0:1])" in msg           # the other stuck head
    assert "cycle:" in msg and "qkv_done[0][0]" in msg and "qkv_done[0][1]" in msg
    assert not machine_completes(s, g, seeds=1)


def test_wait_on_later_task_of_same_sm():
    """One SM whose program puts a QKV task after the ATTN that waits for it."""
    spec, plan = tiny_spec(1), TINY_PLAN
    g = build_step_graph(spec, 1, plan)
    order = list(range(len(g.layer)))
    first_attn = next(t.index for t in g.layer if t.kind == Kind.ATTN)
    order.remove(0)
    order.insert(first_attn, 0)     # QKV[0:48] now right after the first ATTN (group 0)
    s = Schedule(spec, 1, plan, 1, "test", [SMProgram([0, 1], order, [0, 1, 2])])
    rep = validate(s)
    assert rep.failed_check == "deadlock" and "ATTN[g0 s0 b0:1]) waits qkv_done[0][0]" in rep.errors[0]
    assert "program order" in rep.errors[0]
    with pytest.raises(ScheduleError, match="deadlock"):
        EventMachine(s, g).run(None, "round_robin")


def _per_chunk_gateup(g: StepGraph) -> StepGraph:
    """What the builder avoids: DOWN chunk c waits only for the GATEUP tiles of its K-chunk, with no
    gateup_staged guarding the GATEUP tiles' reads of x."""
    ks, I = g.plan.down_ksplit, g.dims.intermediate
    chunk = I // ks
    layer = []
    for t in g.layer:
        if t.kind == Kind.GATEUP:
            t = dataclasses.replace(t, signals=(EventRef("gateup_done", 0, t.r0 // chunk),), staged_signals=0)
        elif t.kind == Kind.DOWN:
            t = dataclasses.replace(t, waits=(EventRef("gateup_done", 0, t.k0 // chunk),))
        layer.append(t)
    per = [0] * ks
    for t in g.layer:
        if t.kind == Kind.GATEUP:
            per[t.r0 // chunk] += 1
    ev = Event("gateup_done", g.num_layers, ks, (tuple(per),) * g.num_layers, True)
    events = {k: v for k, v in g.events.items() if k != "gateup_staged"}
    return _graph_with(g, layer_tasks=layer, events={**events, "gateup_done": ev})


def test_race_per_chunk_gateup(good):
    g2 = _per_chunk_gateup(good.graph())
    rep = validate(good, g2)
    assert rep.failed_check == "races"
    msg = rep.errors[0]
    assert msg.startswith("race on x[") and "DOWN" in msg and "GATEUP" in msg and "adds into it" in msg


def test_staged_guards_order_per_chunk_down():
    """Under tensor parallelism DOWN waits on its K-chunk's gateup_done and on gateup_staged, which
    every GATEUP tile publishes once it has staged x: valid, and racy without the guard."""
    good = round_robin_schedule(tp_share(), TINY_PLAN, 3)
    g = good.graph()
    assert g.plan.down_ksplit > 1 and g.events["gateup_done"].slots == g.plan.down_ksplit
    assert validate(good).ok and brute_force_verdict(good, g) is None
    rep = validate(good, _per_chunk_gateup(g))
    assert rep.failed_check == "races" and "DOWN" in rep.errors[0] and "GATEUP" in rep.errors[0]


def test_staged_signal_orders_only_staged_reads():
    """gateup_staged goes out after a GATEUP tile's staging: valid because the tile's read of x is a
    staged read. The same signal with x read in the body (not staged) lets DOWN add into x while the
    tile may still read it."""
    good = round_robin_schedule(tp_share(), TINY_PLAN, 3)
    g = good.graph()
    gu = [t for t in g.layer if t.kind == Kind.GATEUP]
    assert all(t.staged_signals == 1 and t.signals[0].event == "gateup_staged" for t in gu)
    assert all(any(a.buf == "x" and a.staged for a in t.reads) for t in gu)
    layer = [dataclasses.replace(t, reads=tuple(dataclasses.replace(a, staged=False) for a in t.reads))
             if t.kind == Kind.GATEUP else t for t in g.layer]
    g2 = _graph_with(g, layer_tasks=layer)
    rep = validate(good, g2)
    assert rep.failed_check == "races"
    assert "GATEUP" in rep.errors[0] and "DOWN" in rep.errors[0] and "race on x[" in rep.errors[0]
    assert brute_force_verdict(good, g2) == "races"
    assert machine_completes(good, g2, seeds=1)   # it runs; it is just wrong


def test_race_wrong_access(good):
    """COMBINE of group 0 declared as writing group 1's attn_out too: two unordered plain writes."""
    g = good.graph()
    layer = [dataclasses.replace(t, writes=(Access("attn_out", 0, 64),)) if t.kind == Kind.COMBINE and t.group == 0
             else t for t in g.layer]
    rep = validate(good, _graph_with(g, layer_tasks=layer))
    assert rep.failed_check == "races"
    assert "attn_out[32:64]" in rep.errors[0] and "COMBINE[g0]" in rep.errors[0] and "COMBINE[g1]" in rep.errors[0]


def test_race_on_per_layer_buffer_names_concrete_layer(good):
    """COMBINE g0 declared as writing ATTN[g1 s0]'s KV region (layer-relative): the race must be
    found in every layer, on that layer's own cache."""
    g = good.graph()
    S = g.plan.attn_splits
    layer = [dataclasses.replace(t, writes=t.writes + (Access("kv", S, S + 1, layer=0),))
             if t.kind == Kind.COMBINE and t.group == 0 else t for t in g.layer]
    rep = validate(good, _graph_with(g, layer_tasks=layer))
    assert rep.failed_check == "races"
    for lay in (0, 1):
        assert any(e.startswith(f"race on kv of layer {lay}[{S}:{S + 1}]") and f"layer {lay} COMBINE[g0]" in e
                   and f"layer {lay} ATTN[g1 s0 b0:1]" in e for e in rep.errors), rep.errors


def test_empty_access_conflicts_with_nothing(good):
    g = good.graph()
    layer = [dataclasses.replace(t, writes=t.writes + (Access("x", 5, 5),)) if t.kind == Kind.ATTN else t
             for t in g.layer]
    assert validate(good, _graph_with(g, layer_tasks=layer)).ok


def test_bad_event_reference(good):
    g = good.graph()
    layer = [dataclasses.replace(t, waits=(EventRef("attn_done", 0, 7),)) if t.kind == Kind.COMBINE else t
             for t in g.layer]
    rep = validate(good, _graph_with(g, layer_tasks=layer))
    assert rep.failed_check == "structure" and "attn_done[0][7] outside" in rep.errors[0]


@pytest.mark.parametrize("o_merge", [False, True])
def test_oproj_ksplit_is_judged_like_brute_force(o_merge):
    """OPROJ K-chunks add into x while QKV tiles of groups outside the chunk may still read x for
    their norm (and, with o_merge, read the split partials the next layer's ATTN overwrites);
    whatever the builder emits, the validator must agree with the brute-force checker."""
    spec, plan = tiny_spec(1), dataclasses.replace(TINY_PLAN, o_ksplit=2, o_merge=o_merge)
    s = round_robin_schedule(spec, plan, 4)
    g = s.graph()
    rep = validate(s, g)
    assert (rep.failed_check if not rep.ok else None) == brute_force_verdict(s, g)


def test_checks_full_qwen3_8b_shape():
    spec = ModelSpec(name="qwen3-8b", family="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
    s = round_robin_schedule(spec, TilePlan(down_ksplit=2), 132)
    rep = check(s)
    assert rep.ok
    assert rep.tasks > 36 * 500 and rep.checked_pairs > 10 ** 7


# ----------------------------------------------------------------------------- properties
# every plan the builder emits is legal (OPROJ K-split included: qkv_all orders it)
PLANS = [TINY_PLAN, dataclasses.replace(TINY_PLAN, qkv_rows=32, attn_splits=3, down_ksplit=1),
         dataclasses.replace(TINY_PLAN, o_ksplit=2, attn_splits=1),
         dataclasses.replace(TINY_PLAN, gateup_rows=32, down_rows=64, lm_rows=64, embed_rows=64),
         dataclasses.replace(TINY_PLAN, o_merge=True, o_ksplit=2, attn_splits=3),
         dataclasses.replace(TINY_PLAN, o_merge=True)]
# one rank's share under tensor parallelism 2 (one KV head: no OPROJ K-split); its guards of x are
# staged signals, so a task is two steps (staging, the rest) for the checkers
TP_PLANS = [TINY_PLAN, dataclasses.replace(TINY_PLAN, qkv_rows=32, attn_splits=3, down_ksplit=1),
            dataclasses.replace(TINY_PLAN, gateup_rows=32, down_rows=64, lm_rows=64, embed_rows=64),
            dataclasses.replace(TINY_PLAN, o_merge=True)]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31), plan=st.sampled_from(PLANS), layers=st.integers(1, 2),
       sms=st.integers(1, 5))
def test_random_legal_schedules_are_accepted(seed, plan, layers, sms):
    s = random_legal_schedule(tiny_spec(layers), plan, sms, random.Random(seed))
    g = s.graph()
    rep = validate(s, g)
    assert rep.ok, rep.errors
    assert brute_force_verdict(s, g) is None
    m = EventMachine(s, g)
    m.run(None, "random", seed)


MUTATIONS = ["swap"] * 3 + ["move"] * 3 + ["drop", "dup"] + ["wait_slot", "drop_wait"] * 2 + ["signal_slot"]


def _mutate(s: Schedule, g: StepGraph, rng: random.Random) -> tuple[Schedule, StepGraph]:
    s = _copy(s)
    what = rng.choice(MUTATIONS)
    progs = s.programs
    if what in ("swap", "move", "drop", "dup"):
        cands = [(sm, ph) for sm, p in enumerate(progs) for ph in ("head", "layer", "tail") if getattr(p, ph)]
        sm, ph = rng.choice(cands)
        lst = getattr(progs[sm], ph)
        i = rng.randrange(len(lst))
        if what == "swap":
            j = rng.randrange(len(lst))
            lst[i], lst[j] = lst[j], lst[i]
        elif what == "move":
            x = lst.pop(i)
            dst = getattr(progs[rng.randrange(len(progs))], ph)
            dst.insert(rng.randrange(len(dst) + 1), x)
        elif what == "drop":
            lst.pop(i)
        else:
            dst = getattr(progs[rng.randrange(len(progs))], ph)
            dst.insert(rng.randrange(len(dst) + 1), lst[i])
        return s, g
    # graph mutations on one layer task: retarget a wait (slot or relative row), drop a wait, or
    # retarget a signal (which breaks the per-slot counts)
    field = "signals" if what == "signal_slot" else "waits"
    k = rng.choice([t.index for t in g.layer if getattr(t, field)])
    t = g.layer[k]
    refs = getattr(t, field)
    w = rng.randrange(len(refs))
    ref = refs[w]
    ev = g.events[ref.event]
    if what == "drop_wait":
        new: tuple = ()
    elif rng.random() < (0.8 if ev.slots > 1 else 0.3):
        new = (dataclasses.replace(ref, slot=rng.randrange(ev.slots)),)
    else:
        new = (dataclasses.replace(ref, index=ref.index + rng.choice([-1, 1])),)
    layer = list(g.layer)
    layer[k] = dataclasses.replace(t, **{field: refs[:w] + new + refs[w + 1:]})
    return s, _graph_with(g, layer_tasks=layer)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31), case=st.sampled_from([(False, p) for p in PLANS] + [(True, p) for p in TP_PLANS]),
       layers=st.integers(1, 2), sms=st.integers(1, 4), n_mut=st.integers(1, 3))
def test_mutations_no_false_accept_or_reject(seed, case, layers, sms, n_mut):
    rng = random.Random(seed)
    tp, plan = case
    s = random_legal_schedule(tp_share(layers) if tp else tiny_spec(layers), plan, sms, rng)
    g = s.graph()
    for _ in range(n_mut):
        s, g = _mutate(s, g, rng)
    rep = validate(s, g)
    truth = brute_force_verdict(s, g)
    assert (None if rep.ok else rep.failed_check) == truth, rep.errors
    if rep.ok:
        assert machine_completes(s, g)
    elif truth == "deadlock":   # a cycle blocks every interleaving
        assert not machine_completes(s, g, seeds=1)
