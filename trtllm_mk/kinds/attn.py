"""ATTN: one KV group and split of paged decode attention (QK-norm, RoPE, cache store, partials) for
a range of batch rows."""
from __future__ import annotations

from . import KindDef

ATTN_TILE_TOKENS = 16   # tokens of one ATTN tensor-core tile (the device body's attn_tile)

DEF = KindDef("ATTN", streams_weights=False, args=("layer", "r0", "r1", "group", "split"), device_file="attn.cuh",
              polls=("qkv_done",))

# Cost-model constants (search.calibration: defaults, set per GPU by the calibration files), each
# consumer time of one task. Its cached K/V streams through the ring (duration_us).
CALIBRATION = {
    "attn_fixed_us": (4.0, "per batch row, beyond the bandwidth terms: the chain of dependent reads (qkv "
                           "from L2, QK-norm, RoPE, the cross-warp merge) and the block barriers, for a group "
                           "of FIXED_WIDTH values (the model scales it by the group's width)"),
    "attn_tile_us": (0.8, "one round of tensor-core tiles, a 16-token tile per consumer warp (scores, "
                          "softmax, P V for the group's heads), for TILE_GROUP q heads per KV group (the "
                          "model scales it by the group's heads): a split of more tokens takes more rounds"),
    "attn_late_token_us": (0.0, "per cached token (per batch row) the loader streams through the ring after "
                                "the task's first round (long contexts), beyond the tokens' bytes at the "
                                "loader's rate (0: those only)"),
}
# the q heads per KV group attn_tile_us is given for: a round's mma work grows with the group's heads
TILE_GROUP = 4
# the group width (q heads + k + v, times head_dim) attn_fixed_us is given for: 4 q heads of 128. The
# fixed part stages the group's q, k and v (norms, RoPE, cache stores) and merges every warp's
# [q heads, head_dim] partial across the warps, so it grows with the group's width
FIXED_WIDTH = (TILE_GROUP + 2) * 128


def fixed_scale(dims) -> float:
    """attn_fixed_us's multiple for one batch row of ``dims``'s KV group."""
    return dims.group_rows / FIXED_WIDTH


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch
    from ..model.rope import apply_rope
    from ..smem import plan_kv_ring, split_bounds
    G, d, S, g, s = ex.G, ex.d, ex.S, t.group, t.split
    lw, cache, tpb = ex.layers[layer], ex.cache, ex.cache.tokens_per_block
    plan = ex.graph.plan
    cap = plan_kv_ring(d, plan, ex.graph.dims.context_len)[1]
    for b in range(t.r0, t.r1):
        p = int(ex.pos[b])
        t0, t1 = split_bounds(p, S, plan.attn_kv_run, cap, s)
        heads = ex.qkv[b, g * ex.GR:(g + 1) * ex.GR].view(G + 2, d)
        qk, v = heads[:G + 1], heads[G + 1]
        if ex.spec.qk_norm:
            qk = torch.cat([ex.head_norm(qk[:G], lw["q_norm"]), ex.head_norm(qk[G:], lw["k_norm"])])
        qk = apply_rope(qk[None], torch.tensor([p]), ex.inv_freq)[0]
        q, k, v = qk[:G], ex.stage_round(qk[G]), ex.stage_round(v)
        if t0 <= p < t1:   # this split owns the new token: append it to the cache
            blk = int(cache.block_table[b, p // tpb])
            cache.pool[layer, blk, 0, g, p % tpb] = k.to(cache.pool.dtype)
            cache.pool[layer, blk, 1, g, p % tpb] = v.to(cache.pool.dtype)
        if t1 <= t0:       # an empty split (fewer tokens than splits)
            ex.part_o[b, g, s] = 0.0
            ex.part_ml[b, g, s, :, 0] = float("-inf")
            ex.part_ml[b, g, s, :, 1] = 0.0
            continue
        ts = torch.arange(t0, t1)
        blocks = cache.block_table[b, ts // tpb].long()
        kc = cache.pool[layer, blocks, 0, g, ts % tpb].float()   # [T, d]
        vc = cache.pool[layer, blocks, 1, g, ts % tpb].float()
        if t0 <= p < t1:   # the new token from registers, as the GPU does (same bf16 values)
            kc[p - t0], vc[p - t0] = k, v
        sc = (q * d ** -0.5) @ kc.T                               # [G, T]
        m = sc.max(-1).values
        e = torch.exp(sc - m[:, None])
        ex.part_o[b, g, s] = e @ vc
        ex.part_ml[b, g, s, :, 0] = m
        ex.part_ml[b, g, s, :, 1] = e.sum(-1)


def tile_rounds(tokens: int, cap: int, run: int, warps: int) -> int:
    """Rounds of tensor-core tiles one batch row of a split takes (attn.cuh attn_compute): its
    ``tokens`` (the new one included) arrive in ring rounds of ``cap``; a round's tiles are 16 tokens
    spaced ``run`` apart, ``run`` of them per 16 x ``run`` tokens, and the consumer warps take them in
    turns, a warp's tiles one after another."""
    out, left = 0, tokens
    while left > 0:
        n = min(cap, left) if left > cap + 1 else left   # the new token joins the last round
        out += -(-(run * -(-n // (ATTN_TILE_TOKENS * run))) // warps)
        left -= n
    return max(1, out)


def longest_split(plan, context_len: int, cap: int) -> tuple[int, int]:
    """(tokens the longest KV split attends to, of them cached) in the step at position ``context_len``
    (smem.split_start's bounds, on a ring round of ``cap`` tokens: smem.plan_kv_ring)."""
    from ..smem import attention_chunk
    split = attention_chunk(context_len, plan.attn_splits, plan.attn_kv_run, cap)
    return split, min(split, context_len)


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time of one split: fixed latency, L2 reads, and the tensor-core tile rounds over the
    cached K/V, or the loader's stream of it where that is slower."""
    from ..search.cost import ring_turnover_rate
    from ..smem import plan_kv_ring
    d, plan = graph.dims, graph.plan
    run = plan.attn_kv_run
    # the task's first round (up to `cap` cached tokens of its first row) comes through the ring before
    # its wait, riding along the weight stream; the rest (the first row's later rounds at long
    # contexts, the other rows' rounds behind them in the ring) streams while the consumers compute
    # the earlier rounds (attn.cuh attn_load), at what one SM's loader sustains
    kv_slots, cap = plan_kv_ring(d.head_dim, plan, d.context_len)
    split, chunk = longest_split(plan, d.context_len, cap)
    token = 2 * d.head_dim * 2
    rows = task.rows                  # the task's batch rows, one after another
    kv = rows * chunk * token
    late = rows * split - min(split, cap)
    fill = cap * token / kv_slots     # bytes of one slot of a full round
    issue = min(run, cap) * token / 2 / cal.copy_issue_us     # a copy is one run of K (or V) token rows
    # a round's slots turn over only once the consumers have computed it: its tile rounds hold them
    warps = plan.consumer_warps
    tile_us = cal.attn_tile_us * d.group / TILE_GROUP
    slot_t = tile_rounds(cap, cap, run, warps) * tile_us / kv_slots
    rate = min(rates.hbm, ring_turnover_rate(plan.stages * fill, fill, rates.hbm, slot_t, cal), issue)
    stream_us = late * (token / rate + cal.attn_late_token_us)
    rounds = rows * tile_rounds(split, cap, run, warps)
    return (cal.task_overhead_us + rows * cal.attn_fixed_us * fixed_scale(d) + max(0, task.act_bytes - kv) / rates.l2
            + max(rounds * tile_us, stream_us))


def lower(c) -> list[dict]:
    """One task per KV group, split and tile of batch rows (TilePlan.attn_rows)."""
    from ..graph.tasks import Access, EventRef
    from ..smem import plan_kv_ring
    B, G, S, d, GR = c.B, c.G, c.S, c.d, c.GR
    ctx_chunk = longest_split(c.plan, c.context_len, plan_kv_ring(d, c.plan, c.context_len)[1])[1]
    tiles = c.tiles(B, c.plan.attn_rows or B)
    out = []
    for g in range(c.nkv):
        for s in range(S):
            part = (g * S + s) * G
            done = EventRef("attn_done", 0, g // c.groups_per_chunk if c.plan.o_merge else g)
            for b0, b1 in tiles:
                rows = (b0, b1) if len(tiles) > 1 else None
                n = b1 - b0
                out.append(dict(r0=b0, r1=b1, group=g, split=s, waits=(EventRef("qkv_done", 0, g),), signals=(done,),
                                reads=(Access("qkv", g * GR, (g + 1) * GR, rows=rows), Access("pos", 0, 1),
                                       Access("kv", g * S + s, g * S + s + 1, layer=0, rows=rows)),
                                writes=(Access("kv", g * S + s, g * S + s + 1, layer=0, rows=rows),
                                        Access("part_o", part * d, (part + G) * d, rows=rows),
                                        Access("part_ml", part * 2, (part + G) * 2, rows=rows)),
                                act_bytes=n * (ctx_chunk * 2 * d * 2 + GR * 4 + G * (d + 2) * 4),
                                flops=4 * n * ctx_chunk * G * d))
    return out
