"""EMBED: copies the token's embedding row range into the residual stream x (fixed point, residual.py)."""
from __future__ import annotations

from . import KindDef

DEF = KindDef("EMBED", streams_weights=False, args=("r0", "r1"), device_file="embed.cuh",
              signals_by_data=("resid_ready",))


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    from ..residual import to_fixed
    if ex.tp == 1:
        ex.x[:, t.r0:t.r1] = to_fixed(ex.embed[ex.tokens.long(), t.r0:t.r1])
        return
    # one rank's vocabulary shard: it writes the rows of the tokens it holds (into the x every rank shares)
    local = ex.tokens.long() - ex.vocab_base
    own = (local >= 0) & (local < ex.embed.shape[0])
    ex.x[own, t.r0:t.r1] = to_fixed(ex.embed[local[own], t.r0:t.r1])


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time: the bf16 embedding rows from HBM, the rest of its bytes from L2."""
    d = graph.dims
    rows = task.r1 - task.r0
    emb = d.batch * rows * 2                      # bf16 embedding rows come from HBM
    return cal.task_overhead_us + emb / rates.hbm + (task.act_bytes - emb) / rates.l2


def lower(c) -> list[dict]:
    """HEAD tasks: column tiles of H (graph.builder.Lowering ``c``)."""
    from ..graph.tasks import Access, EventRef
    return [dict(r0=a, r1=b, signals=(EventRef("resid_ready", 0, 0),),
                 reads=(Access("tokens", 0, 1),), writes=(Access("x", a, b),),
                 act_bytes=c.B * (b - a) * (c.wb + 4))
            for a, b in c.tiles(c.H, c.plan.embed_rows or 1024)]
