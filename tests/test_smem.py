"""Shared-memory model: hand-checked arithmetic, K-split effect, overflow rejection, kernel agreement."""
from dataclasses import replace
from pathlib import Path

import pytest

from trtllm_mk.gpus import get_gpu
from trtllm_mk.graph import TilePlan, build_step_graph
from trtllm_mk.model.spec import load_spec
from trtllm_mk.search.plans import no_k_tiling, no_ksplit, ring_candidates, valid
from trtllm_mk.smem import FIXED_BYTES, fits, plan_smem, slot_geometry, without_ksplit

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


@pytest.fixture(scope="module")
def qwen8b():
    return load_spec(MODELS / "qwen3-8b.json")


def test_slot_geometry_hand_checked():
    # QKV row of 4096 bf16 = 8 KB: two rows per 16 KB slot, one piece
    g = slot_geometry(4096, 1, 16384, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.out_rows, g.fill_bytes) == (1, 4096, 2, 2, 16384)
    # DOWN row of 12288 = 24 KB does not fit 16 KB: two pieces of 6144 columns, one row per slot
    g = slot_geometry(12288, 1, 16384, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot, g.fill_bytes) == (2, 6144, 1, 12288)
    assert g.slots_for(16) == 32
    # GATEUP: gate and up rows travel together, so a slot holds at least the pair
    g = slot_geometry(4096, 2, 16384, 8)
    assert (g.pieces, g.rows_per_slot, g.out_rows) == (1, 2, 1)
    g = slot_geometry(4096, 2, 8192, 8)
    assert (g.pieces, g.k_chunk, g.rows_per_slot) == (2, 2048, 2)
    # rows per slot never exceed the consumer warps (the kernel gives each row >= 1 warp)
    assert slot_geometry(1024, 1, 65536, 4).rows_per_slot == 4
    with pytest.raises(ValueError):
        slot_geometry(4096, 2, 16, 8)


def test_plan_smem_hand_checked(qwen8b):
    plan = TilePlan(stages=4, slot_bytes=16384, consumer_warps=8, o_ksplit=1, down_ksplit=1)
    sm = plan_smem(qwen8b, 1, plan)
    # ring 4 x 16 KB; activation: DOWN's whole K range 12288 x 2 B; ATTN scratch ((4+2)*128 + 8*4*130)*4
    assert sm.ring == 65536
    assert sm.per_kind["DOWN"].activation == 24576
    assert sm.per_kind["ATTN"].activation == 19712
    assert sm.activation == 24576
    # reduction scratch: 8 warps x batch 1 x max(rows per slot, 2) x 4 B
    assert sm.scratch == 64
    assert sm.peak == 65536 + 24576 + 64 + FIXED_BYTES == 94272
    # DOWN split in 3: K range 4096 -> 8 KB, now ATTN's scratch is the largest activation
    split = plan_smem(qwen8b, 1, replace(plan, down_ksplit=3))
    assert split.per_kind["DOWN"].activation == 8192
    assert split.peak == 65536 + 19712 + 64 + FIXED_BYTES == 89408


def test_ksplit_shrinks_activation_and_peak(qwen8b):
    base = TilePlan(stages=8, slot_bytes=8192, consumer_warps=4, o_ksplit=1, down_ksplit=1)
    for batch in (1, 4):
        a = plan_smem(qwen8b, batch, base)
        b = plan_smem(qwen8b, batch, replace(base, o_ksplit=4, down_ksplit=6))
        assert b.per_kind["DOWN"].activation * 6 == a.per_kind["DOWN"].activation
        assert b.per_kind["OPROJ"].activation * 4 == a.per_kind["OPROJ"].activation
        assert b.per_kind["DOWN"].total < a.per_kind["DOWN"].total
        assert b.peak < a.peak
    # the larger the batch, the more of the peak K-split saves (the activation grows with B)
    cut = [1 - plan_smem(qwen8b, B, replace(base, down_ksplit=6)).peak / plan_smem(qwen8b, B, base).peak
           for B in (1, 2, 4)]
    assert cut[0] < cut[1] < cut[2]
    assert without_ksplit(replace(base, down_ksplit=6)) == base


def test_overflowing_plans_rejected(qwen8b):
    l20, h100 = get_gpu("L20"), get_gpu("H100-SXM")
    big = TilePlan(stages=16, slot_bytes=8192, o_ksplit=1, down_ksplit=1)       # 128 KB ring
    assert plan_smem(qwen8b, 1, big).peak > l20.smem_per_block_optin
    assert not fits(l20, qwen8b, 1, big) and not valid(big, qwen8b, 1, l20)
    assert fits(h100, qwen8b, 1, big)
    # batch 8 without K-split: 192 KB of DOWN activation alone overflows the L20 whatever the ring
    assert not fits(l20, qwen8b, 8, TilePlan(stages=2, slot_bytes=4096, o_ksplit=1, down_ksplit=1))
    assert fits(l20, qwen8b, 8, TilePlan(stages=2, slot_bytes=4096, o_ksplit=8, down_ksplit=8))
    for p in ring_candidates(TilePlan(o_ksplit=1, down_ksplit=1), qwen8b, 1, l20):
        assert plan_smem(qwen8b, 1, p).peak <= l20.smem_per_block_optin


def test_plan_families(qwen8b):
    p = TilePlan(stages=2, slot_bytes=32768, o_ksplit=1, down_ksplit=1)
    assert no_ksplit(p, qwen8b) and no_k_tiling(p, qwen8b)           # 24 KB DOWN rows fit a slot
    assert no_ksplit(replace(p, slot_bytes=16384), qwen8b)
    assert not no_k_tiling(replace(p, slot_bytes=16384), qwen8b)     # DOWN rows now stream in pieces
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
