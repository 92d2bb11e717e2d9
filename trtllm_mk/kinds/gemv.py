"""What the GEMV kinds (QKV, OPROJ, GATEUP, DOWN, LMHEAD, ROUTER, EGATEUP, EDOWN) share: their weights
stream through the shared-memory ring and the generic GEMV cost (search.cost.task_cost) prices them.
A GEMV kind's module sets ``MATRICES`` (weight matrices interleaved in one ring slot: 2 for gate+up,
the ring geometry's PAIR), ``NORMS_INPUT`` (its staging RMS-norms x, which takes one or two dependent
L2 passes), ``staging_extra_us`` (consumer time its staging adds beyond copying the activation),
``BF16_WEIGHTS`` (it streams bf16 weights whatever the layers' weight format) and ``k_range(spec,
plan)`` (the columns one task reduces over after the plan's K-split: the ring geometry's KT).
smem.geometries builds each kind's ring geometry from these."""
from __future__ import annotations


def no_staging_extra(task, graph, cal) -> float:
    return 0.0
