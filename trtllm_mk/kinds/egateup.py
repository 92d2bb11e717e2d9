"""EGATEUP: GATEUP for the expert of one slot (kinds/route.py): silu(gate) * up of a row range of that
expert, on the normed rows the layer's ROUTER tasks published (moe_xn), into the slot's activation.
Its weights are chosen at run time: its loader waits for the router's logits, routes the rows itself
and then streams them; a slot beyond the step's distinct experts is idle, streams nothing and computes
nothing (its consumers route the rows too). It does not read x: the EDOWN tasks of a slot add into x
as soon as that slot's EGATEUP tiles are done (egateup_done has a slot per expert slot), while other
slots' tiles still run."""
from __future__ import annotations

from . import KindDef
from .gemv import no_staging_extra
from .route import active  # noqa: F401  (the split expert kinds run together)

DEF = KindDef("EGATEUP", streams_weights=True, args=("layer", "r0", "r1", "tile", "stage"), device_file="egateup.cuh",
              device_needs=("GATEUP", "ROUTE"))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks. ``t.slot`` is
    the slot, whose expert the task routes from the logits itself (as its loader and consumers do on
    the GPU); an idle slot computes nothing."""
    from .route import slot_expert
    e = slot_expert(ex, t.slot)
    if e < 0:
        return
    ex.moe_act[t.slot, :, t.r0:t.r1] = expert_act(ex, ex.experts[layer][e], t.r0, t.r1)


def expert_act(ex, expert: dict, r0: int, r1: int, xn=None):
    """silu(gate) * up of rows [r0, r1) of an expert's width, on the normed rows ``xn`` (default: those
    ROUTER published)."""
    import torch
    xn = ex.moe_xn if xn is None else xn
    return torch.nn.functional.silu(xn @ expert["gate"][r0:r1].T) * (xn @ expert["up"][r0:r1].T)

# its loader waits for the task's first event (router_done) and routes before it streams (mk_gemv.cuh gemv_load)
LOADER_WAITS = True

# GEMV cost and ring hooks (kinds/gemv.py)
MATRICES = 2
NORMS_INPUT = False
staging_extra_us = no_staging_extra
BF16_WEIGHTS = False   # the spec's weight format (quantized when the layers are)


def k_range(spec, plan) -> int:
    """Columns a task reduces over (the normed rows ROUTER published): KT of the
    ring geometry (smem.geometries)."""
    return spec.hidden_size


def lower(c) -> list[dict]:
    """For each slot, row tiles of the expert's intermediate width; each row streams gate and up."""
    from ..graph.tasks import Access, EventRef
    B, H = c.B, c.H
    return [dict(r0=a, r1=b, k0=0, k1=H, slot=s, waits=(EventRef("router_done", 0, 0),),
                 signals=(EventRef("egateup_done", 0, s),),
                 reads=(Access("moe_xn", 0, H), Access("router_logits", 0, c.E)),
                 writes=(Access(f"moe_act{s}", a, b),),
                 weight_bytes=2 * c.linear_bytes(b - a, H), act_bytes=B * (H * 4 + (b - a) * 4), flops=4 * B * (b - a) * H)
            for s in range(c.NSLOT) for a, b in c.tiles(c.I, c.plan.gateup_rows)]
