"""Shared-memory model: hand-checked arithmetic, K-split effect, overflow rejection, kernel agreement."""
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mk.gpus import get_gpu
from trtllm_mk.graph import TilePlan, build_step_graph
from trtllm_mk.model.spec import load_spec
from trtllm_mk.search.plans import no_k_tiling, no_ksplit, ring_candidates, valid
from trtllm_mk.smem import (ACT_PAD, FIXED_BYTES, SLOT_PAD, attention_kv_ring, attention_scratch_bytes, fits,
                            gemv_k_ranges, kv_region_bytes, kv_ring_offset, norm_staging_passes, plan_smem, row_bytes, slot_geometry,
                            without_ksplit)

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


@pytest.fixture(scope="module")
def qwen8b():
    return load_spec(MODELS / "qwen3-8b.json")


def test_gemv_k_ranges_from_the_kinds(qwen8b):
    # each GEMV kind of the family's step, in program order: its module's k_range and MATRICES
    from trtllm_mk.graph import Kind
    plan = TilePlan(o_ksplit=4, down_ksplit=6)
    assert list(gemv_k_ranges(qwen8b, plan).items()) == [
        (Kind.QKV, (4096, 1)), (Kind.OPROJ, (4096 // 4, 1)), (Kind.GATEUP, (4096, 2)), (Kind.DOWN, (12288 // 6, 1)),
        (Kind.LMHEAD, (4096, 1))]
    moe = load_spec(MODELS / "qwen3-30b-a3b.json")
    assert list(gemv_k_ranges(moe, plan)) == [Kind.QKV, Kind.OPROJ, Kind.ROUTER, Kind.EGATEUP, Kind.EDOWN, Kind.LMHEAD]
    assert gemv_k_ranges(moe, plan)[Kind.EDOWN] == (moe.moe_intermediate_size // 6, 1)


def test_slot_geometry_hand_checked():
    # QKV rows of 4096 bf16: a slot holds one 16-row mma block, so 16 x KC x 2 <= 16 KB -> KC 512, 8 pieces
    g = slot_geometry(4096, 1, 16384, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.out_rows, g.fill_bytes) == (8, 512, 16, 16, 16384)
    # DOWN rows of 12288: 24 pieces of 512 columns; a group is 16 output rows
    g = slot_geometry(12288, 1, 16384, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.fill_bytes) == (24, 512, 16, 16384)
    assert g.slots_for(16) == 24 and g.slots_for(40) == 72
    assert g.bytes_for(40) == 40 * 12288 * 2          # a partial last group loads only its rows
    # GATEUP: 8 gate rows and their 8 up rows share one 16-row block (rows as wide as QKV's: one copy
    # per row piece, so the pieces are as wide as a block allows), 8 outputs per group
    g = slot_geometry(4096, 2, 16384, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.out_rows) == (8, 512, 16, 8)
    assert g.slots_for(56) == 7 * 8 and g.bytes_for(56) == 2 * 56 * 4096 * 2
    g = slot_geometry(4096, 2, 8192, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.out_rows) == (16, 256, 16, 8)
    # whole rows that leave room: a gate block and an up block (16 outputs per group)
    g = slot_geometry(512, 2, 32768, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.out_rows) == (1, 512, 32, 16)
    # quantized tiles hold 16 rows of one matrix: GATEUP needs a gate block and an up block
    g = slot_geometry(4096, 2, 16384, 8, bits=4, group=128, tile=128)
    assert g.rows_per_slot == 32 and g.out_rows == 16
    # short rows: several blocks per slot, at most 4 (the kernel's slot padding covers 64 rows)
    assert slot_geometry(1024, 1, 65536, 4).rows_per_slot == 32
    assert slot_geometry(256, 1, 65536, 8).rows_per_slot == 64
    with pytest.raises(ValueError):
        slot_geometry(4096, 2, 16, 8)
    with pytest.raises(ValueError):
        slot_geometry(40, 1, 16384, 8)     # K must be a multiple of the mma's 16


def test_uneven_pieces_hand_checked():
    # Qwen2.5-7B's DOWN rows of 18944 = 2^9 x 37 columns: no divisor of 18944 between 512 and 1024 is a
    # multiple of 16 but 592, so dividing pieces would fill 58% of a 32 KB slot; 19 pieces of 1008
    # columns (a 16-row block of 32256 bytes) and a last of 800 fill it
    g = slot_geometry(18944, 1, 32768, 8)
    assert (g.pieces, g.k_chunk, g.last_chunk, g.rows_per_slot) == (19, 1008, 800, 16)
    assert g.slots_for(16) == 19 and g.bytes_for(16) == 16 * 18944 * 2
    assert g.copy_bytes == pytest.approx(2 * 18944 / 19) and g.mean_chunk == pytest.approx(18944 / 19)
    # a row that divides keeps even pieces
    g = slot_geometry(14336, 1, 32768, 8)
    assert (g.pieces, g.k_chunk, g.last_chunk) == (14, 1024, 1024)
    # 4-bit rows of Llama-2-7B's DOWN (11008 = 86 tiles of 128 = 2 x 43): a 16-row block of 30 tiles
    # (68 bytes a row each) fills 32 KB; dividing pieces would be 2 tiles (8.5 KB in four blocks)
    g = slot_geometry(11008, 1, 32768, 8, bits=4, group=128, tile=128)
    assert (g.pieces, g.k_chunk, g.last_chunk, g.rows_per_slot) == (3, 29 * 128, 28 * 128, 16)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4096).map(lambda m: 16 * m), st.sampled_from([8192, 16384, 32768, 49152, 65536]),
       st.sampled_from([1, 2]))
def test_bf16_pieces_are_few_and_cover_the_row(k_range, slot_bytes, pair):
    g = slot_geometry(k_range, pair, slot_bytes, 8)
    widest = slot_bytes // 32 // 16 * 16
    assert g.pieces == -(-k_range // widest)                       # no fewer pieces fit a 16-row block
    assert g.k_chunk % 16 == 0 and g.last_chunk % 16 == 0
    assert 0 < g.last_chunk <= g.k_chunk <= widest
    assert (g.pieces - 1) * g.k_chunk + g.last_chunk == k_range


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 256), st.sampled_from([(4, 32, 128), (4, 128, 128), (4, 128, 256), (8, 128, 128)]),
       st.sampled_from([16384, 32768, 49152]), st.sampled_from([1, 2]))
def test_quantized_pieces_hold_whole_tiles_and_groups(units, fmt, slot_bytes, pair):
    bits, group, tile = fmt
    unit = max(group, tile)
    g = slot_geometry(units * unit, pair, slot_bytes, 8, bits=bits, group=group, tile=tile)
    assert g.k_chunk % unit == 0 and g.last_chunk % unit == 0 and 0 < g.last_chunk <= g.k_chunk
    assert (g.pieces - 1) * g.k_chunk + g.last_chunk == units * unit
    assert 16 * pair * row_bytes(g.k_chunk, bits, group) <= slot_bytes      # a piece fits its slot
    if g.pieces > 1:   # one piece fewer would not
        assert 16 * pair * row_bytes(-(-units // (g.pieces - 1)) * unit, bits, group) > slot_bytes


def test_plan_smem_hand_checked(qwen8b):
    plan = TilePlan(stages=4, slot_bytes=16384, consumer_warps=8, o_ksplit=1, down_ksplit=1)
    sm = plan_smem(qwen8b, 1, plan)
    # ring 4 x (16 KB + 1 KB row skew); activation: DOWN's whole K range (12288 + 8 skew) x 2 B;
    # ATTN scratch (max((4+3)*128 q/k/v and bf16 k/v rows + 2*128*4 q fragments, 8*4*(128+2) warp
    # outputs and (max, sum))
    # + 1*128 RoPE cos/sin + 2*128 QK-norm weights)*4 + one 32-byte AttnRow
    assert sm.ring == 4 * (16384 + SLOT_PAD) == 69632
    assert sm.per_kind["DOWN"].activation == (12288 + ACT_PAD) * 2 == 24592
    assert sm.per_kind["ATTN"].activation == 18208
    assert sm.activation == 24592
    # reduction scratch: 2 buffers x 8 warps x 16 rows x batch 1 x 4 B
    assert sm.scratch == 1024
    assert sm.peak == 69632 + 24704 + 1024 + FIXED_BYTES == 99456    # activation 128-byte aligned
    # DOWN split in 3: K range 4096, now ATTN's scratch is the largest activation
    split = plan_smem(qwen8b, 1, replace(plan, down_ksplit=3))
    assert split.per_kind["DOWN"].activation == (4096 + ACT_PAD) * 2
    assert split.peak == 69632 + 18304 + 1024 + FIXED_BYTES == 93056     # 18208 aligned to 128


def test_ksplit_shrinks_activation_and_peak(qwen8b):
    base = TilePlan(stages=8, slot_bytes=8192, consumer_warps=4, o_ksplit=1, down_ksplit=1)
    for batch in (1, 4):
        a = plan_smem(qwen8b, batch, base)
        b = plan_smem(qwen8b, batch, replace(base, o_ksplit=4, down_ksplit=6))
        assert a.per_kind["DOWN"].activation == batch * (12288 + ACT_PAD) * 2
        assert b.per_kind["DOWN"].activation == batch * (12288 // 6 + ACT_PAD) * 2
        assert b.per_kind["OPROJ"].activation == batch * (4096 // 4 + ACT_PAD) * 2
        assert b.per_kind["DOWN"].total < a.per_kind["DOWN"].total
        assert b.peak < a.peak
    # the larger the batch, the more of the peak K-split saves (the activation grows with B)
    cut = [1 - plan_smem(qwen8b, B, replace(base, down_ksplit=6)).peak / plan_smem(qwen8b, B, base).peak
           for B in (1, 2, 4)]
    assert cut[0] < cut[1] < cut[2]
    assert without_ksplit(replace(base, down_ksplit=6)) == base


def test_overflowing_plans_rejected(qwen8b):
    l20, h100 = get_gpu("L20"), get_gpu("H100-SXM")
    big = TilePlan(stages=16, slot_bytes=8192, o_ksplit=1, down_ksplit=1)       # 144 KB ring
    assert plan_smem(qwen8b, 1, big).peak > l20.smem_per_block_optin
    assert not fits(l20, qwen8b, 1, big) and not valid(big, qwen8b, 1, l20)
    assert fits(h100, qwen8b, 1, big)
    # batch 8 without K-split: 192 KB of DOWN activation alone overflows the L20 whatever the ring
    assert not fits(l20, qwen8b, 8, TilePlan(stages=2, slot_bytes=4096, o_ksplit=1, down_ksplit=1))
    assert fits(l20, qwen8b, 8, TilePlan(stages=2, slot_bytes=4096, o_ksplit=8, down_ksplit=8))
    for p in ring_candidates(TilePlan(o_ksplit=1, down_ksplit=1), qwen8b, 1, l20):
        assert plan_smem(qwen8b, 1, p).peak <= l20.smem_per_block_optin


def test_plan_families(qwen8b):
    tiny = load_spec(MODELS / "tiny-llama.json")
    p = TilePlan(stages=2, slot_bytes=65536, o_ksplit=1, down_ksplit=1)
    assert no_ksplit(p, tiny) and no_k_tiling(p, tiny)                # 16 whole rows of every kind fit a slot
    assert no_ksplit(p, qwen8b) and not no_k_tiling(p, qwen8b)        # 16 DOWN rows of 24 KB do not
    assert not no_ksplit(replace(p, down_ksplit=2), qwen8b)


def test_model_covers_kernel_allocation(qwen8b):
    """The model may over-estimate what the generated kernel allocates, never under-estimate it."""
    codegen = pytest.importorskip("trtllm_mk.codegen.source")
    tiny = load_spec(MODELS / "tiny-llama.json")
    for spec, batch, plan in [
        (qwen8b, 1, TilePlan(stages=4, slot_bytes=16384, o_ksplit=1, down_ksplit=1)),
        (qwen8b, 4, TilePlan(stages=8, slot_bytes=8192, consumer_warps=4, o_ksplit=2, down_ksplit=6)),
        (tiny, 2, TilePlan(qkv_rows=32, o_rows=32, gateup_rows=32, down_rows=32, lm_rows=64, stages=2,
                           slot_bytes=4096, o_ksplit=1, down_ksplit=2, attn_splits=2)),
    ]:
        g = build_step_graph(spec, batch, plan, 64)
        assert plan_smem(spec, batch, plan).peak >= codegen.kernel_smem_bytes(g)
        # one layout: the plan model's ring, activation and red regions are the kernel's
        layout = codegen.kernel_smem_layout(g)
        sm = plan_smem(spec, batch, plan)
        assert layout.region("ring").size == sm.ring and layout.region("red").size == sm.scratch
        assert layout.region("act").size == (sm.activation + 127) // 128 * 128
        end = 0
        for r in layout.regions:   # contiguous, in the kernel's order
            assert r.offset == end
            end += r.size
        assert [r.name for r in layout.regions] == ["ring", "act", "red", "scratch", "bars"]


def test_attention_kv_ring_hand_checked():
    # 8B shapes at context 512, 16 splits: the step at position 512 attends to 513 tokens, 33 per split
    assert attention_kv_ring(128, 32768, 16, 512) == (1, 64)     # K + V of 64 tokens share one 32 KB slot
    assert attention_kv_ring(128, 16384, 16, 512) == (2, 64)     # 32 < 33: K and V take a slot each
    assert attention_kv_ring(64, 4096, 16, 512) == (2, 32)
    assert attention_kv_ring(64, 32768, 16, 8192) == (2, 256)    # long context: the split streams in rounds of 256


def test_attention_scratch_holds_q_fragments_or_the_merge():
    # 8 heads per group, head 128, 2 warps: q/k/v + bf16 k/v rows ((8+3)*128) and q's three-part mma
    # fragments (2*128*8 words) outgrow the warps' merge (2*8*130); + RoPE (128) + norms (256), one AttnRow
    assert attention_scratch_bytes(8, 128, 2, 1) == ((8 + 3) * 128 + 2 * 128 * 8 + 128 + 256) * 4 + 32 == 15392
    # 4 heads, 8 warps (the 8B shapes): the merge ((8*4*130) floats) is the larger
    assert attention_scratch_bytes(4, 128, 8, 1) == (8 * 4 * 130 + 128 + 256) * 4 + 32


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_kv_ring_rows_never_overlap_and_keep_the_bank_skew(head_dim):
    """The ATTN ring layout (mirror of kinds/attn.cuh): every cached token's row lies after the
    previous one's end (before v13 the skew of token 63 reached 112 bytes into token 64's row), the
    eight rows an ldmatrix reads ({T, T + 8, ..., T + 56}) start in eight different 16-byte bank
    groups, and every capacity the ring model hands out fits its slot with the skew."""
    rb = 2 * head_dim
    ends = [kv_ring_offset(u, head_dim) + rb for u in range(1024)]
    assert all(kv_ring_offset(u + 1, head_dim) >= ends[u] for u in range(1023))
    for base in range(0, 1024 - 64, 128):
        for t in range(8):
            groups = {kv_ring_offset(base + t + 8 * j, head_dim) % 128 // 16 for j in range(8)}
            assert len(groups) == 8
    for slot in (4096, 8192, 16384, 32768, 49152, 65536):
        for ctx in (64, 512, 8192):
            slots, cap = attention_kv_ring(head_dim, slot, 8, ctx)
            assert (3 - slots) * kv_region_bytes(head_dim, cap) <= slot + SLOT_PAD


@pytest.mark.parametrize("hidden,batch,warps,passes", [
    (4096, 4, 8, 1),   # 16 whole vectors a thread: held in registers
    (3584, 4, 8, 2),   # 16 with a ragged last one (896 vectors over 256 threads): re-read instead
    (3584, 3, 8, 1),
    (4096, 8, 8, 2),   # 32 vectors
    (128, 8, 8, 1),    # fewer vectors than threads
])
def test_norm_staging_passes(hidden, batch, warps, passes):
    assert norm_staging_passes(hidden, batch, warps) == passes
