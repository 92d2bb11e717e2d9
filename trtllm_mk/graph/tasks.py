"""Task-graph vocabulary: task kinds, event tensors, buffers and tile plans.

One decode step of the model at batch B is a set of tiled tasks. Dependencies are *event tensors*
(ETC): counter arrays ``[index, slot]`` in global memory. A producer adds 1 to each slot it signals
after its stores (release); a consumer waits until its slot reaches ``count[index][slot] * (step+1)``
(acquire). Counters are monotonic across steps, so no reset launch is ever needed.

Semantics of each kind (B batch rows; all buffers fp32 unless noted; "bf16(.)" is the rounding the
GPU applies when it stages an activation in shared memory as the input of a GEMV):

  EMBED  rows [r0,r1) of H      x[b,r] = embed[tokens[b], r]
  QKV    rows [r0,r1) of QKVR   xn = bf16(rmsnorm(x[b]) * ln1); qkv[b,r] = W_qkv[r]·xn (+ bias[r])
                                QKVR rows are ordered by KV group g: the q heads g*G..g*G+G-1, k_g, v_g
  ATTN   group g, split s,      for each b in [r0,r1): L = pos[b]+1, chunk = ceil(L/S), tokens [s*chunk, min(L,..));
         rows [r0,r1) of B      q/k from qkv[b] get QK-norm (qwen3) and RoPE at pos[b]; the split whose
                                range holds pos[b] stores bf16 k,v into the paged cache at pos[b];
                                part_o[b,h,s] = sum_t exp(q·k_t/sqrt(d) - m) v_t, part_ml = (m, l)
  COMBINE group g               attn_out[b, h*d:(h+1)*d] = merge of the S partials of head h
  OPROJ  rows [r0,r1) of H,     x[b,r] += W_o[r, k0:k1]·bf16(attn_out[b, k0:k1])   (K-split: atomic add)
         k [k0,k1) of nh*d      with TilePlan.o_merge there are no COMBINE tasks: OPROJ merges the S
                                partials of its heads itself (the same merge) as it stages attn_out;
                                under TilePlan.expert_fused rows from H on are the router through o,
                                router_acc[b,r-H] += M[r-H, k0:k1]·bf16(attn_out) (kinds/router.py)
  GATEUP rows [r0,r1) of I      xn = bf16(rmsnorm(x[b]) * ln2); act[b,r] = silu(W_g[r]·xn) * (W_u[r]·xn)
  DOWN   rows [r0,r1) of H,     x[b,r] += W_d[r, k0:k1]·bf16(act[b, k0:k1])        (K-split: atomic add)
         k [k0,k1) of I
  LMHEAD rows [r0,r1) of V      xn = bf16(rmsnorm(x[b]) * norm); logits[b,r] = W_lm[r]·xn;
                                lm_val/lm_idx[b, tile] = max and first argmax of the tile
  ARGMAX                        tokens[b] = first argmax over tiles; history[b, pos[b]+1] = tokens[b];
                                then pos[b] += 1 and step += 1: ARGMAX is the step's last task (every
                                other task precedes the LM-head tiles it waits on)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..kinds import Kind


# The GEMV consumers multiply weight tiles by the batch on tensor cores (mma.m16n8k16): the batch
# rows are the mma's 8 N columns, so one step decodes at most 8 sequences.
MAX_BATCH = 8


# Which phase a task belongs to. A schedule is layer-periodic: per SM, its HEAD tasks, then its
# LAYER program repeated for every layer, then its TAIL tasks.
HEAD, LAYER, TAIL = "head", "layer", "tail"


@dataclass(frozen=True)
class EventRef:
    """Slot ``slot`` of row ``index`` of event tensor ``event``. For LAYER tasks, ``index`` is
    relative to the task's layer (the concrete row is ``layer + index``)."""
    event: str
    index: int
    slot: int


@dataclass(frozen=True)
class Access:
    """Elements [lo, hi) of every batch row of buffer ``buf`` (per-layer buffers are told apart by
    ``layer``; -1 for buffers shared by all layers; for LAYER tasks a non-negative ``layer`` is relative
    to the task's layer). Used by the race checker."""
    buf: str
    lo: int
    hi: int
    layer: int = -1
    add: bool = False          # an atomic accumulate (commutes with other adds, not with reads)
    staged: bool = False       # a read done while the task stages its input (Task.staged_signals)
    rows: tuple[int, int] | None = None   # only batch rows [b0, b1) (None: every row)


@dataclass(frozen=True)
class Task:
    kind: Kind
    phase: str                 # HEAD | LAYER | TAIL
    index: int                 # position in its phase's task list (template index for LAYER)
    r0: int = 0                # output rows [r0, r1) (GEMV / EMBED kinds)
    r1: int = 0
    k0: int = 0                # reduction range [k0, k1) (GEMV kinds)
    k1: int = 0
    group: int = 0             # KV group (ATTN, COMBINE)
    split: int = 0             # KV split (ATTN)
    slot: int = 0              # expert slot (EGATEUP, EDOWN, EMLP: kinds/route.py)
    waits: tuple[EventRef, ...] = ()
    signals: tuple[EventRef, ...] = ()
    # The first ``staged_signals`` of ``signals`` are published as soon as the task has staged its
    # input, before its body: they order only its ``staged`` reads (a guard against writers of the
    # staged buffer, who need not wait for the task's results). The rest follow its body.
    staged_signals: int = 0
    reads: tuple[Access, ...] = ()
    writes: tuple[Access, ...] = ()
    weight_bytes: int = 0      # weights streamed by this task (once per step)
    act_bytes: int = 0         # activations / KV read and written (approximate, for the cost model)
    flops: int = 0

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    def reuses_staged_input(self, prev: "Task") -> bool:
        """Whether this GEMV task, run right after ``prev`` on the same SM in the same layer, may skip
        staging its activation: same kind (same norm), same reduction range and the same waits, so
        the staged bytes are the same and still resident in shared memory."""
        return (self.kind.streams_weights and prev.kind == self.kind and prev.phase == self.phase
                and (prev.k0, prev.k1) == (self.k0, self.k1) and prev.waits == self.waits
                and (prev.slot == self.slot or not getattr(self.kind.module, "INPUT_PER_SLOT", False)))

    def label(self) -> str:
        if self.kind in (Kind.ATTN,):
            return f"{self.kind.name}[g{self.group} s{self.split} b{self.r0}:{self.r1}]"
        if self.kind == Kind.COMBINE:
            return f"{self.kind.name}[g{self.group}]"
        if self.kind == Kind.ARGMAX:
            return "ARGMAX"
        k = f" k{self.k0}:{self.k1}" if self.k1 else ""
        s = f" slot{self.slot}" if self.kind in (Kind.EGATEUP, Kind.EDOWN, Kind.EMLP) else ""
        return f"{self.kind.name}[{self.r0}:{self.r1}{k}{s}]"


@dataclass(frozen=True)
class Event:
    """An event tensor: ``rows`` x ``slots`` counters; ``counts[i][s]`` signals per step."""
    name: str
    rows: int
    slots: int
    counts: tuple[tuple[int, ...], ...]
    per_layer: bool            # rows are indexed by layer (LAYER tasks use relative indices)
    # under tensor parallelism: every rank's tasks signal every rank's counter, so a wait needs the
    # signals of all ranks (graph.builder CROSS_RANK_EVENTS)
    cross_rank: bool = False
    # Carried by the data: the producers store their outputs as tagged words and the waiters poll
    # those words (kinds KindDef.signals_by_data / polls), so the kernel keeps no counter for it and
    # the edge costs no release; the CPU executor, the simulator and the race checker keep it as an
    # ordering edge like any other.
    polled: bool = False


KV_RUNS = (8, 16)   # the values of TilePlan.attn_kv_run the device's K/V ring layout takes


@dataclass(frozen=True)
class TilePlan:
    """The tile choices the search makes; the graph builder turns them into tasks."""
    qkv_rows: int = 64         # output rows per QKV task
    o_rows: int = 64           # output rows per OPROJ task
    o_ksplit: int = 1          # OPROJ K-split (divides num_kv_heads: chunks align with KV groups)
    gateup_rows: int = 64      # output rows (of I) per GATEUP task; each row streams gate and up
    down_rows: int = 64
    down_ksplit: int = 1       # DOWN K-split (chunks are multiples of 64 columns of I)
    lm_rows: int = 1024
    embed_rows: int = 0        # 0: one EMBED task per 1024 columns of H
    attn_splits: int = 8       # KV splits per group
    # batch rows per ATTN task (0: all): a task runs its rows one after another, so at batch > 1
    # tasks over fewer rows shorten the attention phase on the chain, for more tasks
    attn_rows: int = 0
    # cached tokens per bank-skew group of an ATTN task's K/V in the ring (smem.kv_ring_offset), which
    # is also one bulk copy's run: longer runs issue fewer, larger copies (what bounds one SM's K/V
    # stream with short rows), and a 16-token tensor-core tile then spans 16 runs, so a round of few
    # tokens leaves more of each tile empty
    attn_kv_run: int = 8
    # OPROJ merges the attention partials of its K-chunk's heads while staging its input, instead of
    # COMBINE tasks writing attn_out: one dependent level (a release, a poll, a load) less on the
    # chain QKV -> ATTN -> OPROJ, for S x the staging bytes (pays with an o_ksplit that gives each
    # OPROJ task few heads).
    o_merge: bool = False
    stages: int = 4            # shared-memory ring slots for weight tiles
    slot_bytes: int = 32768    # bytes per ring slot
    consumer_warps: int = 8
    # Ring slots the loader keeps requested and not yet landed; the rest of the ring only buffers.
    # Every outstanding copy lengthens the queue the chain's L2 round trips wait in, and beyond the few
    # slots per SM that saturate the read bandwidth more copies add no bandwidth. sm_90 bulk-copy path
    # only; not searched (the cost model does not price queueing), so the defaults come from
    # measurements (benchmarks/NOTES.md): 2 while streaming, the fewest that keep the stream at full
    # bandwidth, and no tighter cap on the chain, which is short enough that a tighter cap there keeps
    # the ring from filling before the chain ends.
    inflight_slots: int = 2    # while the consumers stream weights
    inflight_chain: int = 2    # while they wait on an event, stage an input or run ATTN / COMBINE
    # While the loader streams an expert's weights (EGATEUP / EDOWN; 0: the whole ring). Those streams
    # cannot start before the layer's routing, so every SM starts them with an empty ring at once, and
    # the dense kinds' cap would hold each SM to that many bytes per loaded round trip.
    expert_inflight: int = 0
    # One EMLP task per expert tile instead of EGATEUP and EDOWN tasks (and ROUTE): the SM that computes
    # a tile's gate/up rows also streams the matching columns of the expert's down matrix (stored
    # transposed) and adds its partial of every hidden row into x. No EGATEUP -> EDOWN event and no
    # second staging; H adds per tile instead of a tile's rows.
    expert_fused: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TilePlan":
        return cls(**d)


@dataclass(frozen=True)
class Dims:
    """The shapes one decode step is lowered with."""
    batch: int           # sequences decoded per step (B)
    layers: int          # L
    hidden: int          # H
    intermediate: int    # I: the MLP's width (an expert's in a mixture-of-experts model)
    vocab: int           # V
    heads: int           # query heads
    kv_heads: int        # KV heads (= KV groups)
    head_dim: int        # d
    group: int           # query heads per KV head (G)
    splits: int          # KV splits per group (S)
    group_rows: int      # QKV output rows per KV group: (G + 2) * d
    qkv_rows: int        # all QKV output rows: kv_heads * group_rows
    q_dim: int           # heads * head_dim
    n_lm_tiles: int      # LM-head tiles (argmax partials per row)
    context_len: int     # context the ATTN cost estimates assume
    weight_bits: int = 16   # the decoder layers' GEMV weights: 16 (bf16) or 4 (ModelSpec.weight_bits)
    weight_group: int = 0   # columns per scale word of 4-bit weights
    weight_tile: int = 0    # columns per 16-row tile of 4-bit weights (quant/kernel_layout.py tile_cols)
    tensor_parallel: int = 1   # ranks sharing the model (ModelSpec.tensor_parallel)
    experts: int = 0           # mixture of experts: E, and k per token
    experts_per_token: int = 0
    expert_slots: int = 0      # NSLOT = min(E, B * k) (kinds/route.py)
    # a counted residual (trtllm_mk/residual.py, graph.builder counted_residual): the adds into each
    # element of x a layer makes before GATEUP reads it (OPROJ's) and in all; 0: x is not counted
    resid_o_adds: int = 0
    resid_layer_adds: int = 0

    @property
    def resid_counted(self) -> bool:
        return self.resid_layer_adds > 0


@dataclass
class StepGraph:
    """One decode step as head / per-layer template / tail task lists plus event tensors."""
    num_layers: int
    batch: int
    plan: TilePlan
    head: list[Task]
    layer: list[Task]
    tail: list[Task]
    events: dict[str, Event]
    dims: Dims

    def phase_tasks(self, phase: str) -> list[Task]:
        return {HEAD: self.head, LAYER: self.layer, TAIL: self.tail}[phase]

    def num_tasks(self) -> int:
        return len(self.head) + self.num_layers * len(self.layer) + len(self.tail)

    def counter_offsets(self) -> dict[str, int]:
        """The flat counter layout every consumer shares (kernel, CPU executor): the events in name
        order, each ``rows x slots`` counters, row-major; the value is the event's first counter."""
        offsets, n = {}, 0
        for name in sorted(self.events):
            offsets[name] = n
            n += self.events[name].rows * self.events[name].slots
        return offsets

    def resolve(self, task: Task, layer: int, ref: EventRef) -> tuple[str, int, int]:
        """Concrete (event, row, slot) of ``ref`` as used by ``task`` in ``layer``."""
        row = ref.index + (layer if task.phase == LAYER else 0)
        return ref.event, row, ref.slot

    def weight_bytes(self) -> int:
        return (sum(t.weight_bytes for t in self.head) + self.num_layers * sum(t.weight_bytes for t in self.layer)
                + sum(t.weight_bytes for t in self.tail))
