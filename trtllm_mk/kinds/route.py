"""ROUTE: a sparse layer's routing (model/moe.py ``route``: softmax, the k most probable experts with
the lowest index winning ties, renormalised when the family says so) and the step's expert slots.

The decode step has ``NSLOT = min(E, B * k)`` expert slots, the most distinct experts its B rows can
select; the schedule is static, so an expert's GEMV tasks are "slot s", and the slots are filled at
run time: the union of the rows' selected experts in ascending order, then -1 (an idle slot). ROUTE
writes them, and for each slot the routing weight of its expert in each row (0 where the row did not
select it), which EDOWN scales its sums by. An idle slot's EGATEUP and EDOWN tasks stream and compute
nothing; the cost model prices every slot as busy: the static schedule gives each SM its own slots'
tiles, so the step waits for the SMs whose slots are busy whatever the others skip. The loaders of
EGATEUP and EDOWN do not wait for ROUTE: each routes the rows itself as soon as the router's logits
land (route.cuh ExpertSource, the same device functions), so the expert streams start one event
earlier."""
from __future__ import annotations

from . import KindDef

DEF = KindDef("ROUTE", streams_weights=False, args=("layer",), device_file="route.cuh")


def active(spec, plan) -> bool:
    """The split expert kinds (ROUTE, EGATEUP, EDOWN), not under TilePlan.expert_fused: EMLP tasks then
    take the experts (kinds/emlp.py)."""
    return not plan.expert_fused


def slots_of(weights, experts, num_slots: int):
    """(slot experts [NSLOT] int32, -1 idle; slot weights [NSLOT, B] fp32) of the rows' routing
    (``weights``, ``experts`` [B, k] from model.moe.route)."""
    import torch
    chosen = sorted(set(experts.flatten().tolist()))
    slot = torch.full((num_slots,), -1, dtype=torch.int32)
    w = torch.zeros(num_slots, experts.shape[0], dtype=torch.float32)
    for s, e in enumerate(chosen):
        slot[s] = e
        hit = experts == e                                      # [B, k]: at most one per row
        w[s] = (weights.float() * hit).sum(-1)
    return slot, w


def route_slots(ex):
    """The step's (slot experts, slot weights) from the CPU executor's router logits."""
    from ..model.moe import route
    weights, experts = route(ex.router_logits, ex.spec.num_experts_per_tok, ex.spec.norm_topk_prob)
    return slots_of(weights, experts, ex.moe_slot.numel())


def route_fixed(acc, x, k: int, norm_topk: bool, eps: float):
    """(weights [B, k], experts [B, k]) of the routing from logits summed in fixed point along the chain
    (kinds/router.py; ``acc`` [B, E] int64 before the norm, ``x`` [B, H] the residual it norms): the k
    experts of the largest logits, as fp32 values of ``acc`` (the lowest index wins ties), weighted by
    the softmax over all E of acc / rms(x), renormalised over the k when the family says so. The
    ranking needs no norm (1 / rms scales a row's logits alike), so the device's loaders route before
    the rows are normed (route.cuh route_fixed)."""
    import torch

    from ..residual import from_fixed
    key = acc.to(torch.float32)
    experts = torch.sort(-key, dim=-1, stable=True).indices[:, :k]   # equal keys keep index order
    xf = from_fixed(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    probs = torch.softmax(key * 2.0 ** -32 * inv_rms, dim=-1)       # from_fixed(acc) / rms
    weights = probs.gather(-1, experts)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def route_slots_fixed(ex, layer: int):
    """The step's (slot experts, slot weights) from the chain's logits of ``layer`` (EMLP under
    TilePlan.expert_fused)."""
    w, e = route_fixed(ex.router_acc[layer], ex.x, ex.spec.num_experts_per_tok, ex.spec.norm_topk_prob, ex.eps)
    return slots_of(w, e, ex.moe_slot.numel())


def slot_expert(ex, slot: int) -> int:
    """The expert an EGATEUP task computes for ``slot``, routed from the logits as the device's loaders
    and consumers do (EGATEUP does not wait for ROUTE); -1 for an idle slot."""
    return int(route_slots(ex)[0][slot])


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    ex.moe_slot, ex.moe_w = route_slots(ex)


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time: a loaded L2 round trip for the logits, the softmax and k rounds of a warp argmax."""
    return cal.task_overhead_us + cal.l2_latency_us + task.act_bytes / rates.l2 + task.flops / rates.attn


def lower(c) -> list[dict]:
    """One task per layer, after every ROUTER tile."""
    from ..graph.tasks import Access, EventRef
    return [dict(waits=(EventRef("router_done", 0, 0),), signals=(EventRef("route_done", 0, 0),),
                 reads=(Access("router_logits", 0, c.E),), writes=(Access("moe_slots", 0, c.NSLOT),),
                 act_bytes=c.B * c.E * 4 + c.NSLOT * (c.B + 1) * 4, flops=c.B * c.E * (8 + 4 * c.k))]
