"""Shared-memory model of the megakernel: what one CTA needs per task kind, and whether a plan fits.

One persistent CTA per SM holds, in dynamic shared memory:
  ring        ``stages x (slot_bytes + SLOT_PAD)``: the weight ring the loader warp fills for GEMV
              tasks (and, for ATTN tasks, with the cached K/V of their chunk: attention_kv_ring). A
              slot holds ``RS`` = 16 x NB weight rows (NB blocks of the tensor-core mma's 16 rows) of
              ``KC`` columns (the 3-D tile: output rows per slot x K tile, times the batch
              through the activation below); a row of the task's K range that does not fit one slot
              travels in ``NKC`` pieces. Rows sit 16 bytes further apart than their length (bank skew
              for ldmatrix); SLOT_PAD holds that skew. The geometry is ``Geometry`` of the device
              (every generated kernel static_asserts that the two agree for its constants), so the
              ring the model fills is the ring that runs.
  activation  the task's input, resident for the whole task: ``batch x (K_range + 8)`` bf16 for a GEMV
              kind (8 elements of bank skew per row), where K-splitting (TilePlan.o_ksplit,
              down_ksplit) shrinks K_range; ATTN uses the same region as scratch (q/k/v of one KV
              group, then one merge buffer per consumer warp). One region serves every kind, so the
              kernel allocates the largest.
  scratch     cross-warp reduction of the mma partial sums: ``2 x consumer_warps x 16 x batch x 4``
              bytes (double-buffered by row group).
  fixed       4 KB reserved for the small regions: norm / argmax scratch and the mbarriers.
peak = ring + largest activation (128-byte aligned) + largest scratch + fixed <= smem_per_block_optin.

``smem_layout`` is the kernel's layout itself: the regions in order with their offsets, emitted into
the generated source (the device reads its offsets from there, and the host allocates its total).
The search budgets the small regions with the fixed reserve, which always covers them.

The per-kind view (``KindSmem``) is what a kernel that ran only that kind would need; the report
lists it with and without K-split to show where K-splitting pays.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .gpus import GpuSpec
from .kinds import emlp
from .kinds.combine import merge_scratch_bytes
from .graph.tasks import Kind, TilePlan
from .model.families import FAMILIES
from .model.spec import ModelSpec

FIXED_BYTES = 4096
ALIGN = 128


SLOT_PAD = 1024       # bytes of row skew per slot: 16 bytes x up to MAX_BLOCKS x 16 rows
ROW_PAD = 16
ACT_PAD = 8           # bf16 elements of skew after each staged activation row (no GEMV reads them; EDOWN and
                      # EMLP keep per-task floats there: a row's routing weight, EDOWN's idle flag)
MMA_ROWS = 16         # rows of one tensor-core block (mma.m16n8k16)
MAX_BLOCKS = 4
SIG_SLOTS = 4         # signal queue entries between the consumer warps and the signaller warp
TRACE_ACCS = 3        # 64-bit trace accumulators after the chain-hint word (mk_params.cuh TraceAcc)
SCRATCH_BYTES = 256 * 4   # norm / argmax scratch: values [0, 128) and indices [128, 256)


@dataclass(frozen=True)
class SlotGeometry:
    """How one GEMV kind uses a ring slot (``Geometry<KT, PAIR, WBITS>`` of the device; the generated
    kernel checks the two agree). Quantized weights (``bits`` 4: quant/kernel_layout.py) fill a slot
    with rows of ``KC / 2`` code bytes and, after them, the rows' scale words (4 bytes per group)."""
    k_range: int        # KT: columns a task of this kind reduces over (after K-split)
    pair: int           # 2 for GATEUP: gate and up rows of one output row travel together
    pieces: int         # NKC: slots one row group takes
    k_chunk: int        # KC: columns per slot
    rows_per_slot: int  # RS: weight rows per slot (gate + up rows for GATEUP), 16 x blocks
    bits: int = 16      # weight bits: 16 (bf16) or 4
    group: int = 0      # columns per scale word (quantized weights)
    tile: int = 0       # columns per 16-row tile, one bulk copy each (quantized weights)

    @property
    def last_chunk(self) -> int:
        """KC_LAST: columns of a row's last piece (bf16 rows may end in a narrower piece)."""
        return self.k_range - (self.pieces - 1) * self.k_chunk

    @property
    def mean_chunk(self) -> float:
        """Columns per slot, averaged over a row's pieces."""
        return self.k_range / self.pieces

    @property
    def out_rows(self) -> int:
        """Output rows completed per slot group."""
        return self.rows_per_slot // self.pair

    @property
    def fill_bytes(self) -> int:
        """Weight bytes of a full slot (<= slot_bytes)."""
        return self.rows_per_slot * row_bytes(self.k_chunk, self.bits, self.group)

    def slots_for(self, rows: int) -> int:
        """Ring slots a task with ``rows`` output rows streams."""
        return -(-rows // self.out_rows) * self.pieces

    def bytes_for(self, rows: int) -> int:
        """Weight bytes a task with ``rows`` output rows streams (partial last groups load only their rows)."""
        return rows * self.pair * row_bytes(self.k_range, self.bits, self.group)

    @property
    def copy_bytes(self) -> float:
        """Bytes per copy the loader issues: a row piece (bf16), or per 16-row block its tiles and its
        scale words (4-bit)."""
        k = self.mean_chunk
        if self.bits == 16:
            return 2.0 * k
        return MMA_ROWS * (k * self.bits / 8 + 4 * k / self.group) / (k / self.tile + 1)


def row_bytes(k: int, bits: int, group: int) -> int:
    """Bytes of ``k`` columns of one weight row: bf16 values, or 4-bit codes and a scale word per group."""
    return 2 * k if bits == 16 else k * bits // 8 + 4 * (k // group)


def slot_geometry(k_range: int, pair: int, slot_bytes: int, consumer_warps: int, bits: int = 16,
                  group: int = 0, tile: int = 0) -> SlotGeometry:
    """Pieces of a row, then as many 16-row blocks as fit (1, 2 or 4, at most the consumer warps;
    quantized: at least ``pair``). A row streams in as few pieces as a block of slot_bytes allows (16
    rows, where bf16 gate/up pairs of ``pair`` 2 share a block; 16 per matrix for quantized tiles),
    each a whole number of column units (16 for bf16; for quantized weights the tile and the group)
    and as even as they go, the last possibly narrower: a K range such as 18944 = 2^9 x 37 would
    otherwise stream in pieces that divide it, 592 bf16 columns (58% of a 32 KB slot)."""
    q = bits != 16
    unit = MMA_ROWS if not q else max(tile, group)
    block = pair if q else 1          # 16-row blocks one slot group needs at the least
    if k_range % unit or MMA_ROWS * block * row_bytes(unit, bits, group) > slot_bytes:
        raise ValueError(f"K range {k_range} (pair {pair}, {bits}-bit weights) cannot use {slot_bytes}-byte slots")
    widest = slot_bytes // (MMA_ROWS * block * row_bytes(unit, bits, group)) * unit
    n = -(-k_range // widest)
    kc = -(-k_range // (n * unit)) * unit
    if (n - 1) * kc >= k_range:   # even pieces would leave the last empty: full pieces, then the rest
        kc = widest
    nb = slot_bytes // (MMA_ROWS * row_bytes(kc, bits, group))
    nb = min(MAX_BLOCKS if nb >= MAX_BLOCKS else 2 if nb >= 2 else 1, consumer_warps)
    return SlotGeometry(k_range, pair, n, kc, MMA_ROWS * max(nb, block), bits, group if q else 0, tile if q else 0)


def gemv_kinds(spec: ModelSpec, plan: TilePlan) -> tuple[Kind, ...]:
    """The GEMV kinds of the spec's decode step (its family's) under ``plan``, in program order."""
    return tuple(k for _, names in FAMILIES[spec.family].step for k in map(Kind.__getitem__, names)
                 if k.streams_weights and k.active(spec, plan))


def gemv_k_ranges(spec: ModelSpec, plan: TilePlan) -> dict[Kind, tuple[int, int]]:
    """(K range after K-split, pair) per GEMV kind: its module's ``k_range`` and ``MATRICES`` (kinds/gemv.py)."""
    return {k: (k.module.k_range(spec, plan), k.module.MATRICES) for k in gemv_kinds(spec, plan)}


def geometries(spec: ModelSpec, plan: TilePlan) -> dict[Kind, SlotGeometry]:
    """The GEMV kinds stream the spec's weight format, but for those with ``BF16_WEIGHTS`` (kinds/gemv.py)."""
    from .quant.kernel_layout import tile_cols
    out = {}
    tile = tile_cols(spec) if spec.quantized else 0
    for k, (kt, pair) in gemv_k_ranges(spec, plan).items():
        q = spec.quantized and not k.module.BF16_WEIGHTS
        out[k] = slot_geometry(kt, pair, plan.slot_bytes, plan.consumer_warps,
                               spec.weight_bits if q else 16, spec.weight_group if q else 0, tile if q else 0)
    return out


def attention_scratch_bytes(group_size: int, head_dim: int, consumer_warps: int, batch: int) -> int:
    """ATTN's scratch in the activation region (kinds/attn.cuh, ATTN_FRESH .. ATTN_ROWS): q heads + k +
    v of one group in fp32, this step's k and v as bf16 rows and q's mma fragments (three bf16 parts:
    2 x head_dim x G words), overlapped after the tiles by the warps' partial outputs and (max, sum)
    ([consumer_warps][G][head_dim + 2] fp32); then what the prologue gathers before the wait: RoPE
    cos/sin per batch row ([B][head_dim]), the QK-norm weights ([2][head_dim]) and a 32-byte AttnRow
    per batch row."""
    G, d = group_size, head_dim
    rope = -(-max((G + 3) * d + 2 * d * G, consumer_warps * G * (d + 2)) // 4) * 4
    return (rope + batch * d + 2 * d) * 4 + 32 * batch


def split_start(tokens: int, splits: int, run: int, cap: int, split: int) -> int:
    """First token of KV split ``split`` when a step attends to ``tokens`` tokens. A split of at most
    ``cap`` tokens (one ring round, TilePlan's KV_CAP: its copies are issued before the task's wait)
    starts at ``split * ceil(tokens / splits)``. Longer splits stream their later rounds at what the
    loader's copies sustain, and a split starting one token past a cache block cuts every other run
    of ``run`` tokens (TilePlan.attn_kv_run) in two copies: they start at the equal share rounded down
    to a whole run, so no copy crosses a block. The last split ends at the last token (kinds/attn.cuh
    split_start)."""
    if split >= splits:
        return tokens
    share = -(-tokens // splits)
    if share <= cap:
        return min(tokens, split * share)
    return split * tokens // (splits * run) * run


def split_bounds(position: int, splits: int, run: int, cap: int, split: int) -> tuple[int, int]:
    """Tokens ``[t0, t1)`` split ``split`` attends to in the step at ``position`` (empty where
    ``t1 <= t0``: fewer tokens than splits)."""
    n = position + 1
    return split_start(n, splits, run, cap, split), min(n, split_start(n, splits, run, cap, split + 1))


def attention_chunk(context_len: int, splits: int, run: int = 8, cap: int = 0) -> int:
    """Tokens the longest KV split of an ATTN task covers in the step at position ``context_len``
    (which attends to ``context_len + 1`` tokens); ``cap`` as in split_start."""
    return max(b - a for a, b in (split_bounds(context_len, splits, run, cap, s) for s in range(splits)))


def kv_ring_offset(u: int, head_dim: int, run: int = 8) -> int:
    """Byte offset of cached token ``u`` in an ATTN task's K (or V) region of the ring (the device's
    kv_ring_offset in kinds/attn.cuh; the generated kernel checks the two agree): rows of 2 x head_dim
    bytes, a 16-byte bank skew per group of ``run`` tokens, restarting 128 bytes further on every
    8 x ``run`` tokens so that no row reaches into the next. A group is one bulk copy where the cache
    block allows, so longer runs mean fewer, larger copies."""
    return u * 2 * head_dim + ((u // run) & 7) * 16 + (u // (8 * run)) * 128


def kv_region_bytes(head_dim: int, tokens: int, run: int = 8) -> int:
    """Bytes of a K (or V) region of ``tokens`` rows, skew included."""
    return kv_ring_offset(tokens - 1, head_dim, run) + 2 * head_dim


def attention_kv_ring(head_dim: int, slot_bytes: int, splits: int, context_len: int, run: int = 8) -> tuple[int, int]:
    """How an ATTN task takes its cached K/V through the weight ring (kinds/attn.cuh attn_load):
    ``(slots per batch row, tokens each row's K and V hold)``. One slot holds K in its first half and
    V in its second when the split's chunk at ``context_len`` fits; otherwise K and V take a slot each,
    which doubles the tokens. The bank skew of the rows (kv_ring_offset) lives in the slot's SLOT_PAD;
    where it does not fit (long rows in large slots), the capacity shrinks until it does. A split of
    more cached tokens (long contexts) streams through the ring in rounds of that capacity, so any
    capacity is correct and this decides how the rounds cut the split."""
    chunk = -(-(context_len + 1) // splits)          # an equal share of the tokens
    one = slot_bytes // (4 * head_dim)               # tokens of K + V in one slot
    slots, cap = (1, one) if one >= chunk else (2, 2 * one)
    regions = 3 - slots                               # K and V regions per slot
    while cap > 1 and regions * kv_region_bytes(head_dim, cap, run) > slot_bytes + SLOT_PAD:
        cap -= 1
    return slots, cap


def plan_kv_ring(head_dim: int, plan: TilePlan, context_len: int) -> tuple[int, int]:
    """attention_kv_ring for a tile plan: the kernel's (KV_SLOTS, KV_CAP)."""
    return attention_kv_ring(head_dim, plan.slot_bytes, plan.attn_splits, context_len, plan.attn_kv_run)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def norm_staging_passes(hidden: int, batch: int, consumer_warps: int) -> int:
    """Passes over x of the RMSNorm kinds' staging (mk_gemv.cuh stage_normed, generated as
    cfg::NORM_PASSES): one when the batch's rows fit a thread's registers (at most 16 float4), two
    otherwise, and two at exactly 16 when the last vector is ragged (H / 4 not a multiple of the
    consumer threads), whose guards and zero fill then spill the kernel at the register cap."""
    threads = consumer_warps * 32
    vectors = -(-(hidden // 4) // threads) * batch
    return 1 if vectors < 16 or (vectors == 16 and (hidden // 4) % threads == 0) else 2


def activation_bytes(hidden: int, q_size: int, intermediate: int, group: int, head_dim: int, batch: int,
                     plan: TilePlan) -> int:
    """The activation region every kind shares: the largest GEMV input (``batch x (K range + ACT_PAD)``
    bf16, after K-split; OPROJ's followed by its merge factors under ``o_merge``; EMLP's followed by
    its tile's activation under ``expert_fused``), COMBINE's merge
    factors or ATTN's scratch, whichever is larger (unaligned)."""
    k = max(hidden, q_size // plan.o_ksplit, intermediate // plan.down_ksplit)
    fused = emlp.activation_bytes(hidden, batch, plan, ACT_PAD) if plan.expert_fused else 0
    return max(batch * (k + ACT_PAD) * 2, fused, oproj_staging_bytes(q_size, head_dim, batch, plan),
               merge_scratch_bytes(batch, group, plan.attn_splits),
               attention_scratch_bytes(group, head_dim, plan.consumer_warps, batch))


def oproj_staging_bytes(q_size: int, head_dim: int, batch: int, plan: TilePlan) -> int:
    """OPROJ's staged input, and under ``o_merge`` the merge factors of its chunk's heads after it
    (kinds/oproj.cuh stage)."""
    kt = q_size // plan.o_ksplit
    rows = batch * (kt + ACT_PAD) * 2
    return rows + (merge_scratch_bytes(batch, kt // head_dim, plan.attn_splits) if plan.o_merge else 0)


@dataclass(frozen=True)
class SmemRegion:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class SmemLayout:
    """The kernel's dynamic shared memory, region by region (what codegen emits as SMEM_*)."""
    regions: tuple[SmemRegion, ...]

    @property
    def total(self) -> int:
        return self.regions[-1].offset + self.regions[-1].size

    def region(self, name: str) -> SmemRegion:
        return next(r for r in self.regions if r.name == name)


def smem_layout(plan: TilePlan, batch: int, activation: int) -> SmemLayout:
    """[ring][activation / attention scratch][red][scratch][mbarriers]. The ring holds ``stages``
    slots of ``slot_bytes + SLOT_PAD``; the activation region is 128-byte aligned; red holds the
    cross-warp partial sums ([2][consumer_warps][16][batch] fp32); the mbarriers are the ring's full
    and empty barriers, the signal queue's, one word of chain hint and the trace's accumulators."""
    sizes = (("ring", plan.stages * (plan.slot_bytes + SLOT_PAD)), ("act", _align(activation)),
             ("red", 2 * plan.consumer_warps * MMA_ROWS * batch * 4), ("scratch", SCRATCH_BYTES),
             ("bars", (2 * plan.stages + 2 * SIG_SLOTS + 1 + TRACE_ACCS) * 8))
    regions, off = [], 0
    for name, size in sizes:
        regions.append(SmemRegion(name, off, size))
        off += size
    return SmemLayout(tuple(regions))


@dataclass(frozen=True)
class KindSmem:
    kind: str
    ring: int
    activation: int
    scratch: int
    fixed: int

    @property
    def total(self) -> int:
        return self.ring + _align(self.activation) + self.scratch + self.fixed


@dataclass(frozen=True)
class SmemBreakdown:
    """Per task kind needs and the CTA's peak (the kernel's layout with the fixed reserve for its small
    regions: at least what the kernel allocates)."""
    per_kind: dict[str, KindSmem]
    ring: int
    activation: int       # largest activation region over kinds
    scratch: int
    fixed: int
    o_ksplit: int
    down_ksplit: int

    @property
    def peak(self) -> int:
        return self.ring + _align(self.activation) + self.scratch + self.fixed

    def to_dict(self) -> dict:
        return {"peak": self.peak, "ring": self.ring, "activation": self.activation, "scratch": self.scratch,
                "fixed": self.fixed, "o_ksplit": self.o_ksplit, "down_ksplit": self.down_ksplit,
                "per_kind": {k: {**asdict(v), "total": v.total} for k, v in self.per_kind.items()}}


def plan_smem(spec: ModelSpec, batch: int, plan: TilePlan) -> SmemBreakdown:
    """Shared memory of ``plan`` at batch ``batch``, per task kind and peak."""
    layout = smem_layout(plan, batch, activation_bytes(spec.hidden_size, spec.q_size, spec.mlp_intermediate,
                                                       spec.group_size, spec.head_dim, batch, plan))
    small = layout.region("scratch").size + layout.region("bars").size
    if small > FIXED_BYTES:
        raise ValueError(f"{plan.stages} ring stages need {small} B of barriers and scratch, more than the "
                         f"{FIXED_BYTES} B reserved")
    ring = layout.region("ring").size
    per: dict[str, KindSmem] = {}
    for kind, geo in geometries(spec, plan).items():
        act = batch * (geo.k_range + ACT_PAD) * 2
        if kind == Kind.OPROJ:
            act = oproj_staging_bytes(spec.q_size, spec.head_dim, batch, plan)
        if kind == Kind.EMLP:
            act = emlp.activation_bytes(spec.hidden_size, batch, plan, ACT_PAD)
        scratch = layout.region("red").size
        per[kind.name] = KindSmem(kind.name, ring, act, scratch, FIXED_BYTES)
    # Of the non-GEMV kinds only ATTN needs scratch of its own; its cached K/V borrows ring slots
    # (attention_kv_ring), which the GEMV kinds' ring already counts.
    attn = attention_scratch_bytes(spec.group_size, spec.head_dim, plan.consumer_warps, batch)
    per[Kind.ATTN.name] = KindSmem(Kind.ATTN.name, 0, attn, 0, FIXED_BYTES)
    return SmemBreakdown(per_kind=per, ring=ring, activation=max(v.activation for v in per.values()),
                         scratch=max(v.scratch for v in per.values()), fixed=FIXED_BYTES,
                         o_ksplit=plan.o_ksplit, down_ksplit=plan.down_ksplit)


def without_ksplit(plan: TilePlan) -> TilePlan:
    return replace(plan, o_ksplit=1, down_ksplit=1)


def fits(gpu: GpuSpec, spec: ModelSpec, batch: int, plan: TilePlan) -> bool:
    """Whether ``plan`` fits one CTA's opt-in shared memory on ``gpu`` (and its slots can hold the
    smallest piece of every GEMV kind)."""
    try:
        return plan_smem(spec, batch, plan).peak <= gpu.smem_per_block_optin
    except ValueError:
        return False
