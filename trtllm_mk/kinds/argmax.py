"""ARGMAX: the step's last task: next tokens from the tiles' maxima (greedy rows), or sampled as
trtllm_mk/sampling.py defines (rows with SamplingParams); advances pos and the step."""
from __future__ import annotations

from ..errors import UserError
from . import KindDef

DEF = KindDef("ARGMAX", streams_weights=False, args=(), device_file="argmax.cuh")

NO_TOKEN = 0x7FFFFFFF   # an argmax with no candidate (the device's initial index)


class NonFiniteLogits(UserError):
    """A decode step produced no usable logit for some row."""


def execute(ex, t, layer: int) -> None:
    """CPU-executor semantics (trtllm_mk.executor.CpuExecutor ``ex``): see graph.tasks."""
    import torch

    from ..sampling import sample, with_logprobs
    best = ex.lm_val.max(-1, keepdim=True).values
    # first argmax overall: the smallest index among the tiles that hold the maximum
    big = torch.iinfo(torch.int32).max
    tok = torch.where(ex.lm_val == best, ex.lm_idx, torch.full_like(ex.lm_idx, big)).min(-1).values
    bad = (tok == NO_TOKEN).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteLogits(f"the logits of batch row {bad[0]} are all NaN or -inf (the weights or the KV cache "
                              "hold non-finite values)")
    for b, p in enumerate(ex.sampling):   # rows that sample or want log-probabilities (device/mk_sampling.cuh)
        if p is None or p.plain_greedy:
            continue
        n = int(ex.pos[b]) + 1   # the position of the token being chosen
        c = with_logprobs(ex.logits[b], int(tok[b]), p.logprobs) if p.greedy else sample(ex.logits[b], p, n)
        tok[b] = c.token
        if c.logprob is not None:
            ex.logprobs[b, 0] = c.logprob
            for j, (i, lp) in enumerate(c.top_logprobs or []):
                ex.top_ids[b, j], ex.logprobs[b, 1 + j] = i, lp
    ex.tokens.copy_(tok)
    for b in range(ex.B):
        nxt = int(ex.pos[b]) + 1
        if nxt < ex.history.shape[1]:
            ex.history[b, nxt] = tok[b]
    ex.pos += 1   # ARGMAX ends the step: every other task (all that read pos) precedes it


def duration_us(task, graph, rates, cal) -> float:
    """Consumer time: one loaded L2 round trip and the tiles' maxima from L2."""
    return cal.task_overhead_us + cal.l2_latency_us + task.act_bytes / rates.l2 + task.flops / rates.attn


def lower(c) -> list[dict]:
    """The one TAIL task after every LM-head tile."""
    from ..graph.tasks import Access, EventRef
    n = len(c.lm_tiles)
    return [dict(waits=(EventRef("lm_done", 0, 0),),
                 reads=(Access("lm_part", 0, n), Access("pos", 0, 1)),
                 writes=(Access("tokens", 0, 1), Access("history", 0, 1)),
                 act_bytes=c.B * n * 8)]
