"""What the GEMV kinds (QKV, OPROJ, GATEUP, DOWN, LMHEAD) share: their weights stream through the
shared-memory ring and the generic GEMV cost (search.cost.task_cost) prices them. A GEMV kind's
module sets ``MATRICES`` (weight matrices interleaved in one ring slot: 2 for gate+up),
``NORMS_INPUT`` (its staging RMS-norms x, which takes one or two dependent L2 passes) and
``staging_extra_us`` (consumer time its staging adds beyond copying the activation)."""
from __future__ import annotations


def no_staging_extra(task, graph, cal) -> float:
    return 0.0
