"""Constants of the cost model that are not datasheet facts, with defaults and an optional measured file.

``Calibration`` holds the machine's constants (below) and the task kinds' (each kind module's
``CALIBRATION``, collected by ``kinds.calibration_constants``), read as attributes alike.
``load_calibration(gpu)`` starts from the defaults and overrides any field found in
``trtllm_mk/data/calibration/<gpu name>.json`` (written by the calibration benchmark on a real GPU). A
file with an unknown key or a negative value is rejected: a silently ignored typo would make every
prediction quietly wrong.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..gpus import GpuSpec
from ..kinds import calibration_constants
from ..parallel.allreduce_cost import UNMEASURED, LinkModel

CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"

# Boost clocks (GHz) from the datasheets; the cost model needs them for the per-SM FMA and
# shared-memory rates, which GpuSpec does not carry.
SM_CLOCK_GHZ = {"L20": 2.52, "L40S": 2.52, "A100-80GB": 1.41, "H100-SXM": 1.98, "H200": 1.98}


@dataclass(frozen=True)
class MachineCalibration:
    """The machine's constants and the methods of ``Calibration``, which adds the kinds' constants."""
    # Time from a producer's release atomicAdd until a consumer spinning with acquire loads on
    # another SM sees the new count and its block is released (global-memory round trip + barrier).
    sync_us: float = 1.0
    # Fixed consumer cost of every task: argument decode, block barriers, output epilogue, signal.
    task_overhead_us: float = 0.3
    # One kernel launch (from a CUDA graph): added once per decode step.
    launch_us: float = 4.0
    # DRAM latency seen by the loader: a ring slot is reusable only after its bytes landed and were
    # consumed, so a ring of C bytes sustains at most C / (latency + ...) bytes/us (Little's law).
    mem_latency_us: float = 0.8
    # Time from a copy's issue until the consumer finds its slot full, at the end of a task's stream
    # (traced: the loader's last issue -> the reduction done, less the last slot's math); 0 takes
    # mem_latency_us. Apart from the ring's turnover latency because the turnover constant is fitted to
    # step times and absorbs what the ring's depth costs elsewhere (the in-flight cap, the releases).
    landing_us: float = 0.0
    # Loader time per GEMV task before its first copy issues (reading the task's arguments, its first
    # slot's barrier): the streams of many small tasks lose it once each (traced: the loader's last
    # issue of a task -> its start of the next).
    loader_task_us: float = 0.0
    # Time from a task's end (its events handed to the signaller warp) until the signaller's release has
    # published them: it delays the waiters, not the consumer, which goes on to its next task (traced:
    # handed -> published).
    publish_us: float = 0.0
    # The same release when the task's end was set by its consumer rather than by its stream: its
    # loader then sits on a full ring and refills one freed slot at a time, so the release's fence does
    # not queue behind a stream's copies (traced: handed -> published of a prefetched chain kind or a
    # 4-bit kind); 0 = publish_us.
    publish_idle_us: float = 0.0
    # A polled event (graph.tasks Event.polled): from its producer's end until a waiter has loaded the
    # tagged words it stored (no release, no counter poll); 0: priced as a counted event (the release's
    # publish_us or publish_idle_us, then sync_us).
    poll_us: float = 0.0
    # Activations live in L2; a consumer reads them at this multiple of its HBM share.
    l2_bw_factor: float = 3.0
    # The staging of an RMSNorm kind (QKV, GATEUP, the LM head, the router, the experts) reads the
    # residual x (8-byte fixed point, written by the previous phase's reductions from every SM) at this
    # multiple of its HBM share; 0 = l2_bw_factor.
    norm_stage_bw_factor: float = 0.0
    # One dependent L2 round trip of the consumer while the loaders stream (queued behind their
    # traffic): a staging pass of a GEMV activation costs one (traced: OPROJ / DOWN staging).
    l2_latency_us: float = 0.6
    # A single SM cannot pull more than this multiple of its fair share (read_bandwidth / sm_count)
    # even when few SMs stream.
    sm_bw_cap: float = 4.0
    # Fraction of the per-SM shared-memory bandwidth a GEMV consumer turns into weight bytes reduced
    # (ldmatrix + activation loads + mma issue), and of the fp32 FMA peak attention reaches.
    consumer_efficiency: float = 0.5
    # Consumer warps needed to reach that fraction (two per SM sub-partition hide the latency of
    # shared-memory loads and FMA chains); with fewer, the consumer rates scale down linearly.
    full_rate_warps: int = 8
    # Per ring slot: mbarrier wait on 'full', arrive on 'empty'.
    slot_overhead_us: float = 0.02
    # Loader time per weight-row copy (a TMA bulk copy on sm_90, a row of 16-byte cp.async on
    # sm_80/89): slots of many short rows cap the loader's rate at fill / (rows x this). A bulk copy
    # costs about the same whatever its length, so short rows starve the ring (benchmarks/micro/
    # ring_stream.cu measures it; the per-GPU values and their sources are in the calibration files).
    copy_issue_us: float = 0.01
    # Largest ring slot (bytes) the search may use; 0 = any. A limit, not a model term: large slots
    # lengthen every release of a streaming SM, which nothing in this model prices (benchmarks/NOTES.md).
    max_slot_bytes: int = 0
    # Smallest ring slot (bytes) the search may use where a ring of them fits; 0 = any. Also a limit:
    # the in-flight cap counts slots (TilePlan.inflight_slots), so smaller slots keep fewer bytes in
    # flight, which the model (pricing ring bytes) does not see (benchmarks/NOTES.md).
    min_slot_bytes: int = 0
    # Consumer time per quantized (4- or 8-bit) weight against a bf16 weight's: the same mma after
    # shifts, masks and bf16x2 operations per pair of codes, but fewer shared-memory reads (issue-bound
    # where bf16 is shared-memory bound).
    quant_consumer_cost: float = 1.0
    # Per ring slot of quantized weights, in place of slot_overhead_us; 0 = slot_overhead_us. A warp
    # dequantizes its share of a slot as one chain (code loads, unpacking, mma) that starts only when
    # the slot is full and must end before the slot is released, so each slot pays that chain's
    # latency once: slots that hold few 4-bit weights are consumer-bound on it.
    quant_slot_overhead_us: float = 0.0
    # Fixed consumer cost of a GEMV task with quantized weights, in place of task_overhead_us; 0 =
    # task_overhead_us. task_overhead_us is fitted to bf16 steps, whose weight kinds stream: their
    # fixed cost hides behind the stream and the constant absorbs what else those steps spend. A
    # quantized task is consumer-bound (its loader sits on a full ring), so its fixed cost adds to its
    # end: traced, the 4-bit tasks' staging and body take about their model's stage and slot work.
    quant_task_overhead_us: float = 0.0
    # Largest ring slot (bytes) for quantized weights; 0 = max_slot_bytes. A 4-bit block of a slot is
    # about a quarter of a bf16 one's bytes, so the bf16 limit leaves quantized slots short.
    quant_max_slot_bytes: int = 0
    # Per output row group (16 x blocks rows): cross-warp reduction barrier and the epilogue stores.
    group_overhead_us: float = 0.1
    # Shared-memory bandwidth per SM per clock (bytes); the same on sm_80, sm_89 and sm_90.
    smem_bytes_per_clk: float = 128.0
    # fp32 lanes per SM (sm_80: 64, sm_89/sm_90: 128); 0 takes the value of the GPU's architecture.
    fp32_lanes: int = 0
    # SM clock (GHz); 0 takes SM_CLOCK_GHZ[gpu].
    sm_clock_ghz: float = 0.0
    # Streaming read bandwidth (bytes/s); 0 takes gpu.read_bandwidth (datasheet x measured fraction).
    read_bandwidth: float = 0.0
    # Tensor parallelism, between the GPUs of one host (benchmarks/micro/nvlink.cu measures them;
    # calibrate.py --from-links writes them; the defaults are parallel.allreduce_cost.UNMEASURED's
    # assumptions). What a cross-rank event adds to a local event's latency (system-scope fence, adds
    # on every rank, the peer's poll):
    link_sync_us: float = UNMEASURED.sync_us
    # Bytes per second one GPU sends to its peers, all links together (the one-shot all-reduce's slope).
    link_bandwidth: float = UNMEASURED.link_bandwidth
    # Consumer time per KB of fixed-point partials one SM adds into one other rank's residual (the
    # OPROJ / DOWN epilogue under tensor parallelism: 64-bit reductions over the link); the default is an
    # assumption too (allreduce_cost's model has no such term).
    link_add_us_per_kb: float = 0.12
    # Where the link constants come from ("" while they are the defaults).
    link_source: str = ""

    def resolved(self, gpu: GpuSpec) -> "Calibration":
        """Fill the GPU-dependent zero fields from the catalog."""
        lanes = self.fp32_lanes or (64 if gpu.compute_capability == (8, 0) else 128)
        clock = self.sm_clock_ghz or SM_CLOCK_GHZ.get(gpu.name, 1.5)
        bw = self.read_bandwidth or gpu.read_bandwidth
        return replace(self, fp32_lanes=lanes, sm_clock_ghz=clock, read_bandwidth=bw,
                       landing_us=self.landing_us or self.mem_latency_us,
                       publish_idle_us=self.publish_idle_us or self.publish_us,
                       norm_stage_bw_factor=self.norm_stage_bw_factor or self.l2_bw_factor)

    def slot_sizes(self, candidates: tuple[int, ...], with_min: bool = True,
                   quantized: bool = False) -> tuple[int, ...]:
        """The ring slot sizes among ``candidates`` the search may use (see max_slot_bytes or, for
        ``quantized`` layer weights, quant_max_slot_bytes and, unless ``with_min`` is false,
        min_slot_bytes)."""
        top = self._for_weights("max_slot_bytes", quantized)
        return tuple(s for s in candidates if (not top or s <= top) and (not with_min or s >= self.min_slot_bytes))

    def _for_weights(self, name: str, quantized: bool):
        """Constant ``name``, or for quantized weights its ``quant_`` twin where that is set (0 = unset)."""
        return (getattr(self, "quant_" + name) or getattr(self, name)) if quantized else getattr(self, name)

    def slot_overhead(self, quantized: bool) -> float:
        """Consumer time per ring slot (slot_overhead_us, or quant_slot_overhead_us for quantized weights)."""
        return self._for_weights("slot_overhead_us", quantized)

    def task_overhead(self, quantized: bool) -> float:
        """Fixed consumer cost of a GEMV task (task_overhead_us, or quant_task_overhead_us for quantized weights)."""
        return self._for_weights("task_overhead_us", quantized)

    def link(self) -> LinkModel:
        """The all-reduce cost model's view of the link (parallel.allreduce_cost)."""
        return LinkModel(sync_us=self.link_sync_us, link_bandwidth=self.link_bandwidth,
                         reduce_bandwidth=self.read_bandwidth or UNMEASURED.reduce_bandwidth,
                         measured=bool(self.link_source))

    def to_dict(self) -> dict:
        return asdict(self)


def _kind_fields() -> list:
    """The kinds' constants as fields: default, and metadata naming the kind and saying why."""
    kinds = calibration_constants()
    clash = sorted(set(kinds) & ({f.name for f in fields(MachineCalibration)} | {"source"}))
    if clash:
        raise ValueError(f"kind calibration constants {clash} are also the machine's")
    return [(name, type(default), field(default=default, metadata={"kind": kind, "why": why}))
            for name, (default, why, kind) in kinds.items()]


# The machine's constants, the kinds' (each kind module's CALIBRATION), then where the values came from.
Calibration = make_dataclass(
    "Calibration", _kind_fields() + [("source", str, field(default="defaults"))], bases=(MachineCalibration,),
    frozen=True, namespace={"__module__": __name__, "__doc__": "The cost model's constants: the machine's "
                            "(MachineCalibration) and the task kinds' (their modules' CALIBRATION)."})


def load_calibration(gpu: GpuSpec | str, directory: Path | None = None) -> Calibration:
    """Defaults overridden by ``<directory>/<gpu>.json`` when it exists (directory defaults to
    the package's data/calibration)."""
    name = gpu.name if isinstance(gpu, GpuSpec) else str(gpu)
    path = (directory or CALIBRATION_DIR) / f"{name}.json"
    cal = Calibration()
    if not path.is_file():
        raise ConfigError(f"{path}: no calibration file for {name}; every GPU the search targets needs one "
                          "(benchmarks/calibrate.py writes it on that GPU; a file holding only a \"_note\" "
                          "states that the defaults are used)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of calibration constants")
    known = {f.name for f in fields(Calibration) if f.name not in ("source", "link_source")}
    values = {}
    for k, v in data.items():
        if k.startswith("_"):          # comments / provenance (e.g. "_measured_on")
            continue
        if k not in known:
            raise ConfigError(f"{path}: unknown calibration key '{k}'; known: {', '.join(sorted(known))}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{path}: '{k}' must be a non-negative number, got {v!r}")
        values[k] = type(getattr(cal, k))(v)
    if any(k.startswith("link_") for k in values):
        values["link_source"] = str(data.get("_link_source") or path)
    return replace(cal, source=str(path), **values)
