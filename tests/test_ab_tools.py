"""The A/B and trace tools' CPU paths (scripts/mk_ab.py, scripts/mk_trace.py): a saved schedule as a
variant, and a saved trace summarized again. No GPU needed."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from mk_ab import check_params_prefix, params_fields, parse_variant, variant_schedule  # noqa: E402
from mk_trace import ring_args, summarize_saved  # noqa: E402
from trtllm_mk.gpus import get_gpu  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.runtime.trace import task_records  # noqa: E402
from trtllm_mk.schedule import Schedule  # noqa: E402
from trtllm_mk.search import predict  # noqa: E402

V30 = ROOT / "benchmarks" / "results" / "h200_v30_2026-11-29"
SAVED = V30 / "model_fit" / "schedule_v29_1b_b1_512.json"
TRACE = ROOT / "benchmarks" / "results" / "h200_v29_2026-11-29" / "call6" / "trace_o128" / "trace_llama-3.1-8b_b4.npz"


def test_a_schedule_variant_runs_the_saved_schedule_repredicted():
    name, sets, _, src, sched, cp_async = parse_variant(f"old:schedule={SAVED},+attn_mark=0")
    assert (name, sets, src, sched, cp_async) == ("old", {}, None, str(SAVED), 0)
    gpu = get_gpu("H200")
    s = variant_schedule(resolve_model("llama-3.2-1b").spec, 1, 512, gpu, {}, sched)
    saved = Schedule.load(SAVED)
    assert s.programs == saved.programs and s.plan == saved.plan
    # predicted under this tree's calibration, as the variants searched or list-scheduled here
    assert s.predicted_step_us == pytest.approx(predict(saved, gpu).step_us)


def test_a_cp_async_variant_compiles_the_cp_async_ring_with_its_loader_warps():
    name, sets, diag, _, _, cp_async = parse_variant("cp3:cp_async=3,stages=4,+prefetch_next=0")
    assert (name, sets, diag.changed(), cp_async) == ("cp3", {"stages": 4}, {"prefetch_next": 0}, 3)
    args = ring_args(get_gpu("H200"), cp_async)
    assert args == {"use_bulk_copy": False, "loader_warps": 3}
    assert ring_args(get_gpu("H200")) == {"use_bulk_copy": True} and ring_args(get_gpu("L20")) == {"use_bulk_copy": False}


def _mk_ab_error(batch: int, variant: str) -> list[str]:
    """The stderr lines of a ``scripts/mk_ab.py --prebuild`` of the 1B that fails without a traceback."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mk_ab.py"), "llama-3.2-1b", "--batch", str(batch),
                        "--prebuild", "--gpu", "H200", "--variant", variant], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()


def test_a_schedule_of_another_deployment_is_one_line():
    assert _mk_ab_error(4, f"old:schedule={SAVED}") == [f"error: {SAVED}: a schedule of llama-3.2-1b b1 ctx 512, not of "
                                                        "llama-3.2-1b b4 ctx 512"]


def test_a_schedule_variant_with_plan_fields_is_one_line_that_says_so():
    """schedule= runs the saved programs as they are: a field= beside it is refused for what it is,
    even when the schedule is of this very deployment."""
    assert _mk_ab_error(1, f"old:schedule={SAVED},stages=4,o_rows=64") == [
        f"error: {SAVED}: a schedule= variant takes no field= (o_rows, stages): save the changed plan as a schedule "
        "of its own"]


def test_a_trace_of_a_saved_schedule_of_other_weights_is_one_line():
    """mk_trace --schedule traces a saved schedule; one of bf16 weights asked for with --weights w4a16 (the
    kernel would bind other tensors) ends in one line, as does a --set beside it."""
    cmd = [sys.executable, str(ROOT / "scripts" / "mk_trace.py"), "llama-3.2-1b", "--prebuild", "--gpu", "H200",
           "--schedule", str(SAVED)]
    r = subprocess.run(cmd + ["--weights", "w4a16"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {SAVED}: a schedule of llama-3.2-1b b1 (16-bit weights), not "
                                             "of llama-3.2-1b b1 (4-bit)"]
    r = subprocess.run(cmd + ["--set", "stages=4"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and r.stderr.strip().endswith("(and it takes no --set)")


def test_a_saved_trace_summarized_again_gains_the_landing_and_keeps_the_measurement(tmp_path):
    summarize_saved(TRACE, tmp_path)
    out = json.loads((tmp_path / TRACE.with_suffix(".json").name).read_text())
    saved = json.loads(TRACE.with_suffix(".json").read_text())
    assert out["measured_p50_us"] == saved["measured_p50_us"] and out["plan"] == saved["plan"]
    d = np.load(TRACE)
    recs = [r for r in task_records(Schedule.from_json(bytes(d["schedule"]).decode()), d["tasks"])
            if r.kind.name == "GATEUP"]
    landing = np.mean([r.t_computed - r.l1 for r in recs])
    assert out["kinds"]["GATEUP"]["mean_landing_us"] == pytest.approx(landing, abs=1e-3)
    assert "mean_landing_us" not in saved["kinds"]["GATEUP"]


def test_a_plan_variant_the_kernel_cannot_run_is_one_line():
    """A field= variant (mk_ab) or --set (mk_trace) is list-scheduled from the shipped plan: a plan
    that needs more shared memory than one CTA may use failed only at launch (CUDA_ERROR_INVALID_VALUE),
    and an unknown field or a malformed item with a traceback; each ends in one line now."""
    from mk_trace import planned_variant
    gpu = get_gpu("H200")
    saved = Schedule.load(SAVED)
    spec = saved.spec
    ok = planned_variant(spec, 1, 512, gpu, saved.plan, {"stages": 4})
    assert ok.plan.stages == 4 and ok.plan.qkv_rows == saved.plan.qkv_rows
    with pytest.raises(SystemExit) as e:
        planned_variant(spec, 1, 512, gpu, saved.plan, {"slot_bytes": 65536, "stages": 8})
    assert "slot_bytes=65536,stages=8: the plan needs" in str(e.value)
    assert f"more than the {gpu.smem_per_block_optin} B one CTA may use on {gpu.name}" in str(e.value)
    with pytest.raises(SystemExit) as e:
        planned_variant(spec, 1, 512, gpu, saved.plan, {"gateup_rows": 12})
    assert "gateup_rows=12: TilePlan.gateup_rows=12 must be a positive multiple of 8" in str(e.value)
    with pytest.raises(SystemExit) as e:
        planned_variant(spec, 1, 512, gpu, saved.plan, {"gate_rows": 64})
    assert str(e.value).startswith("error: gate_rows: not a tile plan field (qkv_rows, ")
    with pytest.raises(SystemExit) as e:
        parse_variant("x:stages=four")
    assert str(e.value).startswith("--variant x:stages=four: stages=four: expected FIELD=INTEGER")


def test_a_src_kernel_must_read_a_prefix_of_this_trees_params():
    """mk_ab.py packs this tree's Params for a src= kernel: a kernel whose struct is a prefix of it (an older
    tree's, before fields were appended) runs; one whose fields part from it is refused in one line."""
    from trtllm_mk import seam
    ours = [f.name for f in seam.PARAMS]
    def source(names):
        return "struct Params {\n" + "".join(f"  long long* {n};  // [B, H] a; b\n" for n in names) + "};\n"
    assert params_fields(source(ours)) == ours
    check_params_prefix(source(ours), "same.cu")
    check_params_prefix(source(ours[:-1]), "older.cu")
    with pytest.raises(SystemExit) as e:
        check_params_prefix(source(ours[:3] + ["extra"] + ours[3:]), "moved.cu")
    assert str(e.value).startswith("error: moved.cu: its kernel's Params is not a prefix of this tree's (they part at "
                                   "field 3: extra vs ")
    with pytest.raises(SystemExit):
        check_params_prefix("__global__ void k() {}", "none.cu")


def _tiny_kernel_cubin(tmp_path):
    """A cubin with a kernel and two non-inlined device functions named as the megakernel's task bodies."""
    import shutil
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc is not installed")
    src = tmp_path / "k.cu"
    src.write_text("""
namespace mk { struct Ctx { int v; };
template <int K> __device__ __noinline__ Ctx run_task(Ctx c) { for (int i = 0; i < K * 8; ++i) c.v = c.v * 3 + i; return c; } }
__global__ void mk_decode_step(int* out) { mk::Ctx c{(int)threadIdx.x}; c = mk::run_task<1>(c); c = mk::run_task<5>(c); out[threadIdx.x] = c.v; }
""")
    cubin = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-O3", "-o", str(cubin), str(src)], check=True)
    return cubin


def test_stall_samples_land_in_the_kind_whose_function_holds_them(tmp_path):
    from mk_stalls import by_kind, function_symbols, read_rows, report
    from trtllm_mk.kinds import Kind
    funcs = function_symbols(_tiny_kernel_cubin(tmp_path))
    names = {n: (v, s) for v, s, n in funcs}
    qkv = next(vs for n, vs in names.items() if "run_taskILi1E" in n)
    gateup = next(vs for n, vs in names.items() if "run_taskILi5E" in n)
    assert qkv[1] > 0 and gateup[1] > 0 and qkv[0] != gateup[0]
    # an ncu source page: the kernel's first instruction, then one inside each task body
    base = 0x7F0000000000
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb",
              "stall_barrier (Not Issued)"]
    rows = [[hex(base), "LDC R1", "3", "0", "0", "0"],
            [hex(base + qkv[0] + 16), "BAR.SYNC", "10", "9", "1", "9"],
            [hex(base + gateup[0] + gateup[1] - 16), "BRA", "7", "0", "7", "0"]]
    path = tmp_path / "src.csv"
    path.write_text('"Kernel Name","mk_decode_step"\n' + "\n".join(",".join(f'"{c}"' for c in r)
                                                                   for r in [header] + rows) + "\n")
    h, r = read_rows(path)
    kinds, placed = by_kind(h, r, funcs)
    assert kinds[Kind(1).name]["all"] == 10 and kinds[Kind(1).name]["barrier"] == 9
    assert kinds[Kind(5).name]["all"] == 7 and kinds[Kind(5).name]["long_sb"] == 7
    assert kinds["kernel entry"]["all"] == 3
    text = report(kinds, placed, top=3)
    assert f"| {Kind(1).name} | 10 | 50.0% | barrier 90%, long_sb 10% |" in text
