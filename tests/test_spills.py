"""Register spills: ptxas's report parsed per function, kept with cached cubins, and a build that
passes over plans whose kernels spill (or fails, or ships with megakernel.allow_spills).

Compiles with nvcc (no GPU); sm_90a targets (the tiny model on an H100 SXM)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trtllm_mk.build import SpillError, build_engine
from trtllm_mk.codegen.ptxas import demangle, parse_ptxas
from trtllm_mk.config import load_config, with_overrides
from trtllm_mk.engine import kernel_function_name
from trtllm_mk.errors import ConfigError
from trtllm_mk.graph.tasks import TilePlan
from trtllm_mk.search import search
from trtllm_mk.codegen.source import shared_call_arguments
from trtllm_mk.spill_policy import ALL_FIELDS, MARGINAL_SPILL_BYTES, SpilledPlans, function_fields

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
FIXTURE = Path(__file__).parent / "data" / "ptxas_run_program_spills_sm90a.txt"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                                reason="nvcc not installed")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cubin cache for the module: the spilling plan compiles once for all its builds."""
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("cubin_cache")
    mp.setenv("TRTLLM_MK_CACHE", str(d))
    yield d
    mp.undo()


def test_parse_recorded_report_with_spills():
    rep = parse_ptxas(FIXTURE.read_text())
    assert rep.arch == "sm_90a" and rep.registers == 168
    entry = rep.entries[0]
    assert entry.name == "mk_decode_step" and entry.stack_frame == 128 and not entry.spills
    prog = rep.function("run_program")
    assert (prog.spill_stores, prog.spill_loads, prog.registers, prog.entry) == (2400, 4520, None, False)
    assert rep.function("run_task<5>").spill_stores == 32 and rep.function("run_task<5>").spill_loads == 24
    assert rep.function("run_task<0>").spills is False
    assert [f.readable for f in rep.spilling] == ["run_program", "run_task<1>", "run_task<2>", "run_task<5>"]
    assert (rep.spill_stores, rep.spill_loads) == (2400 + 16 + 16 + 32, 4520 + 16 + 16 + 24)
    # nvcc's warnings on the same stream are not functions
    assert all(not f.name.startswith("/") for f in rep.functions) and len(rep.functions) == 15
    line = rep.describe_spills(kernel_function_name)
    assert line.startswith("run_program 2400 B stores / 4520 B loads, run_task<QKV> 16 B stores")
    d = rep.to_dict(kernel_function_name)
    assert d["functions"]["run_task<GATEUP>"]["spill_loads"] == 24 and d["registers"] == 168


def test_demangle():
    assert demangle("_Z11run_programN2mk3CtxE") == "run_program"
    assert demangle("_ZN2mk8run_taskILi3EEENS_3CtxES1_NS_8TaskArgsE") == "run_task<3>"
    assert demangle("_ZN2mk15attn_fetch_lateERKNS_6ParamsEiiiiiiPhS3_") == "attn_fetch_late"
    assert demangle("mk_decode_step") == "mk_decode_step"
    assert kernel_function_name("run_task<3>") == "run_task<COMBINE>"
    assert kernel_function_name("prefetch_next_step<99>") == "prefetch_next_step<99>"


@needs_nvcc
def test_live_report_and_cache_hit_keep_it(cache):
    from trtllm_mk.codegen import compile_cubin
    # 96 live floats under a 32-register bound (1024 threads, 2 blocks per SM): ptxas must spill
    src = """extern "C" __global__ void __launch_bounds__(1024, 2) mk_small(const float* p, float* q, int n) {
  float a[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) a[i] = p[i * n + threadIdx.x];
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 96; ++j) s += a[j] * a[(j * 7) % 96];
#pragma unroll
  for (int i = 0; i < 96; ++i) q[i * n + threadIdx.x] = a[95 - i] * s;
}
"""
    cubin, text = compile_cubin(src, "sm_90a")
    rep = parse_ptxas(text)
    f = rep.function("mk_small")
    assert rep.arch == "sm_90a" and f.entry and 0 < f.registers <= 32 and f.stack_frame > 0
    assert f.spill_stores > 0 and f.spill_loads > 0 and rep.spilling == (f,)
    assert (cubin.with_suffix(".ptxas.txt")).read_text() == text
    _, again = compile_cubin(src, "sm_90a")              # a cache hit knows its report
    assert parse_ptxas(again) == rep
    cubin.with_suffix(".ptxas.txt").unlink()             # a cubin without its report is compiled again
    _, third = compile_cubin(src, "sm_90a")
    assert parse_ptxas(third) == rep and cubin.with_suffix(".ptxas.txt").exists()


def _tiny_schedule(**plan):
    from trtllm_mk.gpus import get_gpu
    from trtllm_mk.model.registry import resolve_model
    from trtllm_mk.search import schedule_plan
    return schedule_plan(resolve_model("tiny-llama").spec, 1, get_gpu("H100-SXM"), TilePlan(**plan), 512)


def _spilling(*names, stores=32, loads=24):
    text = "".join(f"ptxas info    : Function properties for {n}\n"
                   f"    0 bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n" for n in names)
    return parse_ptxas(text)


def test_shared_call_arguments_are_what_every_call_passes_alike():
    # one GATEUP task: its rows are literals every call shares; 8-row tiles: rows differ between calls
    one, many = _tiny_schedule(gateup_rows=256), _tiny_schedule(gateup_rows=8)
    a, b = shared_call_arguments(one)["run_task<GATEUP>"], shared_call_arguments(many)["run_task<GATEUP>"]
    assert a[:3] == (None, "0", "256") and b[:3] == (None, None, None)   # the layer index is never known
    assert a[3:] == b[3:] and "prefetch_next_step<GATEUP>" not in shared_call_arguments(one)


def test_spill_policy_keys():
    assert function_fields("run_task<COMBINE>") == ("attn_splits", "consumer_warps")
    assert function_fields("run_program") == ALL_FIELDS
    seen = SpilledPlans(kernel_function_name)
    seen.add(_tiny_schedule(attn_splits=16), _spilling("_ZN2mk8run_taskILi3EEENS_3CtxES1_NS_8TaskArgsE"))
    assert set(seen.keys) == {"run_task<COMBINE>"}
    # COMBINE's code: its fields and the arguments its calls share, not the ring or other kinds' rows
    assert seen.expected_to_spill(_tiny_schedule(attn_splits=16, stages=8, o_rows=8, lm_rows=256))
    assert not seen.expected_to_spill(_tiny_schedule(attn_splits=8))
    # the rows of a kind reach its body when every call passes the same ones
    gate = SpilledPlans(kernel_function_name)
    gate.add(_tiny_schedule(gateup_rows=256), _spilling("_ZN2mk8run_taskILi5EEENS_3CtxES1_NS_8TaskArgsE"))
    assert set(gate.keys) == {"run_task<GATEUP>"}
    assert gate.expected_to_spill(_tiny_schedule(gateup_rows=256, lm_rows=256, attn_splits=16))
    assert not gate.expected_to_spill(_tiny_schedule(gateup_rows=8))
    assert not gate.expected_to_spill(_tiny_schedule(gateup_rows=256, stages=3))
    # run_program is the task list itself: keyed on every compile-time field
    prog = SpilledPlans(kernel_function_name)
    prog.add(_tiny_schedule(), _spilling("_Z11run_programN2mk3CtxE"))
    assert prog.expected_to_spill(_tiny_schedule(qkv_rows=8)) and not prog.expected_to_spill(_tiny_schedule(stages=3))


def test_a_body_at_the_register_cap_passes_over_only_the_same_plan():
    # one register of spills: the same plan spills alike, another tile of another kind may not
    qkv = "_ZN2mk8run_taskILi1EEENS_3CtxES1_NS_8TaskArgsE"
    cap = SpilledPlans(kernel_function_name)
    cap.add(_tiny_schedule(o_rows=8), _spilling(qkv, stores=MARGINAL_SPILL_BYTES, loads=MARGINAL_SPILL_BYTES))
    assert cap.expected_to_spill(_tiny_schedule(o_rows=8))
    assert not cap.expected_to_spill(_tiny_schedule(o_rows=16)) and not cap.expected_to_spill(_tiny_schedule(lm_rows=256))
    # more than one register: over the cap on its own code, whatever the other kinds' tiles
    over = SpilledPlans(kernel_function_name)
    over.add(_tiny_schedule(o_rows=8), _spilling(qkv, stores=2 * MARGINAL_SPILL_BYTES, loads=MARGINAL_SPILL_BYTES))
    assert over.expected_to_spill(_tiny_schedule(o_rows=16)) and not over.expected_to_spill(_tiny_schedule(stages=3))


def tiny_cfg(**mk):
    return with_overrides(load_config(TINY), {"megakernel": {"search_budget_s": 1.0, **mk}})


def spilling_cfg(**mk):
    # batch 8 at context 2048: the search's first plan splits the KV 64 ways, and COMBINE's 64
    # partials do not fit the registers
    return with_overrides(load_config(TINY), {"max_batch_size": 8, "max_seq_len": 2048, "max_input_len": 64,
                                              "megakernel": {"search_budget_s": 1.0, "context_len": 2048, **mk}})


@needs_nvcc
def test_non_spilling_build_is_unchanged(cache, tmp_path):
    cfg = tiny_cfg()
    lines = []
    out, rep = build_engine(cfg, tmp_path / "eng", show_progress=False, log=lines.append)
    assert lines == []
    sched, _ = search(cfg.model_spec, cfg.max_batch_size, cfg.gpu_spec, context_len=cfg.megakernel.context_len,
                      budget_s=cfg.megakernel.search_budget_s, seed=cfg.megakernel.seed)
    sched.save(tmp_path / "searched.json")
    assert (out / "schedule.json").read_bytes() == (tmp_path / "searched.json").read_bytes()
    k = rep["kernel"]
    assert k["plan_rank"] == 1 and k["plans_skipped"] == [] and k["spills"] is None
    assert k["spill_stores"] == 0 and k["registers"] == parse_ptxas((out / "ptxas.txt").read_text()).registers
    res = json.loads((out / "kernel.json").read_text())["resources"]
    assert res["spill_stores"] == res["spill_loads"] == 0 and "run_task<ATTN>" in res["functions"]
    assert "## Kernel (sm_90a, ptxas)" in (out / "report.md").read_text()


@needs_nvcc
def test_spilling_plan_is_skipped(cache, tmp_path):
    lines = []
    out, rep = build_engine(spilling_cfg(max_plan_attempts=3), tmp_path / "eng", show_progress=False,
                            log=lines.append)
    k = rep["kernel"]
    first = k["plans_skipped"][0]
    assert first["rank"] == 1 and first["plan"]["attn_splits"] == 64 and "run_task<COMBINE>" in first["spills"]
    assert first["spill_stores"] > 0 and k["plan_rank"] == len(k["plans_skipped"]) + 1
    assert k["spill_stores"] == k["spill_loads"] == 0 and k["spills"] is None
    shipped = parse_ptxas((out / "ptxas.txt").read_text())
    assert shipped.spilling == () and json.loads((out / "schedule.json").read_text())["plan"]["attn_splits"] != 64
    assert lines[0].startswith("plan 1 (predicted") and "skipped: its kernel spills registers" in lines[0]
    md = (out / "report.md").read_text()
    assert "Plans skipped because their kernels spill registers" in md


@needs_nvcc
def test_every_plan_spilling_fails_or_ships_when_allowed(cache, tmp_path):
    with pytest.raises(SpillError, match=r"every one of the 1 ranked plans compiled spills registers.*B of stores"):
        build_engine(spilling_cfg(max_plan_attempts=1), tmp_path / "eng", show_progress=False, log=lambda s: None)
    assert not (tmp_path / "eng").exists()
    lines = []
    out, rep = build_engine(spilling_cfg(max_plan_attempts=1, allow_spills=True), tmp_path / "eng",
                            show_progress=False, log=lines.append)
    k = rep["kernel"]
    assert lines[-1].startswith("WARNING: every one of the 1 ranked plans") and k["allow_spills"]
    assert k["spill_stores"] > 0 and "run_task<COMBINE>" in k["spills"] and k["plans_skipped"] == []
    assert json.loads((out / "kernel.json").read_text())["resources"]["spill_stores"] == k["spill_stores"]
    assert "WARNING: the kernel spills registers" in (out / "report.md").read_text()
    from trtllm_mk.cli.build import summary
    assert "SPILLS" in summary(out, rep)


@needs_nvcc
def test_benchmarks_measure_the_plan_a_build_ships(cache, tmp_path):
    """The benchmark's schedule (build.shipped_schedule, what benchmarks/megakernel_system.py and the
    A/B and trace scripts time) is the build's choice, not the search's first plan when that spills."""
    from trtllm_mk.build import shipped_schedule
    cfg = spilling_cfg(max_plan_attempts=3)
    mk = cfg.megakernel
    out, rep = build_engine(cfg, tmp_path / "eng", show_progress=False, log=lambda s: None)
    assert rep["kernel"]["plans_skipped"]                     # the search's first plan spills
    sched = shipped_schedule(cfg.model_spec, cfg.max_batch_size, cfg.gpu_spec, mk.context_len, mk.search_budget_s,
                             cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len, max_plans=3, seed=mk.seed)
    assert sched.plan.to_dict() == json.loads((out / "schedule.json").read_text())["plan"]
    assert sched.plan.attn_splits != 64


def test_config_spill_options():
    cfg = tiny_cfg(allow_spills=True, max_plan_attempts=2)
    assert cfg.megakernel.allow_spills is True and cfg.megakernel.max_plan_attempts == 2
    assert load_config(TINY).megakernel.allow_spills is False
    with pytest.raises(ConfigError, match="megakernel.allow_spills: expected true or false"):
        tiny_cfg(allow_spills="yes")
    with pytest.raises(ConfigError, match="megakernel.max_plan_attempts: 0 must be >= 1"):
        tiny_cfg(max_plan_attempts=0)
