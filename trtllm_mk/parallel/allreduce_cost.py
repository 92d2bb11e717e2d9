"""A cost model of the all-reduce between the GPUs of one host (NVLink through NVSwitch), for the
search to choose, per message size, between the two in-kernel variants:

* one-shot: every rank writes its whole partial into every peer's buffer, one synchronisation, then
  each rank adds the ``tp`` partials itself (in rank order: ``emulate.all_reduce``). One latency;
  each GPU sends ``(tp - 1) * S`` bytes.
* two-shot: reduce-scatter (rank r gathers and adds slice r of every partial), then all-gather of the
  reduced slices. Two latencies; each GPU sends ``2 * (tp - 1) / tp * S`` bytes.

So one-shot wins on small messages (a decode step's ``batch x hidden`` partials: kilobytes) and
two-shot on large ones; the crossover is where the extra latency equals the time of the bytes saved
(``crossover_bytes``). With two ranks both variants send the same bytes, and two-shot saves only
local reading, so its crossover lies far above a decode step's messages.

The parameters are calibration constants (``Calibration.link()`` builds this model from a GPU's
calibration file). ``UNMEASURED`` holds the defaults of a GPU whose link was never measured: NVLink 4's
450 GB/s per direction per GPU at an assumed 80 % efficiency, and an assumed 1.5 us per cross-GPU flag
handshake. ``fit_one_shot`` derives both from timings of one-shot all-reduces of several sizes
(benchmarks/micro/nvlink.cu on a machine with several GPUs; benchmarks/calibrate.py --from-links).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model.spec import ModelSpec

ONE_SHOT, TWO_SHOT = "one_shot", "two_shot"


@dataclass(frozen=True)
class LinkModel:
    sync_us: float            # one cross-GPU synchronisation: a flag written to peers and seen by them
    link_bandwidth: float     # bytes/s one GPU sends to its peers, all links together
    reduce_bandwidth: float   # bytes/s at which a GPU reads the partials it adds (HBM / L2)
    measured: bool = False    # False: the values are assumptions, not fitted to any timing

    def __post_init__(self):
        if self.sync_us < 0 or self.link_bandwidth <= 0 or self.reduce_bandwidth <= 0:
            raise ValueError(f"LinkModel needs sync_us >= 0 and positive bandwidths, got {self}")


# Unmeasured defaults (see the module docstring): replace them with ``fit_one_shot`` of a measurement.
UNMEASURED = LinkModel(sync_us=1.5, link_bandwidth=0.8 * 450e9, reduce_bandwidth=3.0e12, measured=False)


def _check(nbytes: float, tp: int) -> None:
    if nbytes < 0 or tp < 1:
        raise ValueError(f"all-reduce of {nbytes} bytes over {tp} ranks")


def one_shot_us(nbytes: float, tp: int, link: LinkModel = UNMEASURED) -> float:
    """Microseconds of a one-shot all-reduce of ``nbytes`` per rank over ``tp`` ranks."""
    _check(nbytes, tp)
    if tp == 1:
        return 0.0
    return link.sync_us + 1e6 * ((tp - 1) * nbytes / link.link_bandwidth + tp * nbytes / link.reduce_bandwidth)


def two_shot_us(nbytes: float, tp: int, link: LinkModel = UNMEASURED) -> float:
    """Microseconds of a two-shot (reduce-scatter + all-gather) all-reduce of ``nbytes`` per rank."""
    _check(nbytes, tp)
    if tp == 1:
        return 0.0
    sent = 2 * (tp - 1) / tp * nbytes
    return 2 * link.sync_us + 1e6 * (sent / link.link_bandwidth + nbytes / link.reduce_bandwidth)


def choose(nbytes: float, tp: int, link: LinkModel = UNMEASURED) -> tuple[str, float]:
    """(variant, microseconds) of the cheaper all-reduce; one-shot on a tie."""
    one, two = one_shot_us(nbytes, tp, link), two_shot_us(nbytes, tp, link)
    return (ONE_SHOT, one) if one <= two else (TWO_SHOT, two)


def crossover_bytes(tp: int, link: LinkModel = UNMEASURED) -> float | None:
    """The message size above which two-shot is cheaper; None when it never is (one rank)."""
    # one_shot_us - two_shot_us = slope * nbytes - sync_us: the time of the bytes two-shot saves
    # (sending, and reading partials) against its second synchronisation
    slope = 1e6 * (((tp - 1) - 2 * (tp - 1) / tp) / link.link_bandwidth + (tp - 1) / link.reduce_bandwidth)
    if slope <= 0:
        return None
    return link.sync_us / slope


def decode_step_comm_us(spec: ModelSpec, batch: int, tp: int, link: LinkModel = UNMEASURED,
                        element_bytes: int = 4) -> dict[str, float]:
    """The communication of one tensor-parallel decode step: two all-reduces of ``batch x hidden``
    partials per layer (after o_proj and after down_proj; ``element_bytes`` 4 for fp32 partials, 8 for
    the fixed-point residual), one for the vocab-parallel embedding, and the cross-rank argmax (each
    rank's best value and index per row, one-shot). Microseconds by part and in total."""
    msg = batch * spec.hidden_size * element_bytes
    per_layer = 2 * choose(msg, tp, link)[1]
    out = {"layers": spec.num_layers * per_layer, "embedding": choose(msg, tp, link)[1],
           "argmax": one_shot_us(batch * 8, tp, link)}
    out["total"] = sum(out.values())
    return out


def fit_one_shot(samples: Sequence[tuple[float, float]], tp: int,
                 reduce_bandwidth: float = UNMEASURED.reduce_bandwidth) -> LinkModel:
    """A measured LinkModel from one-shot all-reduce timings ``(bytes per rank, microseconds)`` over
    ``tp`` ranks: least squares of ``us = sync + bytes * slope``, the local reduction (at
    ``reduce_bandwidth``) taken out of the slope."""
    if tp < 2:
        raise ValueError("a link needs at least two ranks to be measured")
    if len({b for b, _ in samples}) < 2:
        raise ValueError("fit_one_shot needs timings of at least two message sizes")
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(t for _, t in samples) / n
    slope = (sum((b - mx) * (t - my) for b, t in samples) / sum((b - mx) ** 2 for b, _ in samples))
    sync = my - slope * mx
    link_slope = slope - 1e6 * tp / reduce_bandwidth
    if slope <= 0 or link_slope <= 0 or sync < 0:
        raise ValueError(f"timings do not fit a latency + bandwidth model (latency {sync:.3g} us, "
                         f"{slope:.3g} us per byte)")
    return LinkModel(sync_us=sync, link_bandwidth=1e6 * (tp - 1) / link_slope, reduce_bandwidth=reduce_bandwidth,
                     measured=True)
