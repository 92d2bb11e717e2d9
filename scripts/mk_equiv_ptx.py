"""Check that two source trees generate the same megakernel: same PTX for the same schedules.

For every deployment config, the schedule is searched once with the reference tree (``--ref``) and
saved; both trees then generate the kernel source from that same schedule.json and nvcc compiles
each to PTX (the engine's arch for the config's GPU). The PTX texts are compared with comments and
``.loc`` / ``.file`` lines removed and nvcc's per-file symbol prefix normalized, so a change that only
moves source lines compares equal. The Params bytes each tree's runtime packs for the same fake
pointers are compared too.

    python scripts/mk_equiv_ptx.py --ref /path/to/old/tree --new . [--configs configs/h100_bs1.yaml ...]

Exit code 0: every config identical; 1: a difference (the first differing lines are printed).
One config compiles at a time.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_SEARCH = r"""
import sys
from trtllm_mk.config import load_config
from trtllm_mk.search import search
cfg = load_config(sys.argv[1])
schedule, _ = search(cfg.model_spec, cfg.max_batch_size, cfg.gpu_spec, context_len=cfg.megakernel.context_len,
                     budget_s=float(sys.argv[3]), seed=cfg.megakernel.seed, show_progress=False)
schedule.save(sys.argv[2])
"""

_GENERATE = r"""
import sys
from trtllm_mk.config import load_config
from trtllm_mk.schedule import Schedule
from trtllm_mk.codegen import generate_source
cfg = load_config(sys.argv[1])
schedule = Schedule.load(sys.argv[2])
src, _ = generate_source(schedule, cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len, cfg.gpu_spec.has_tma)
open(sys.argv[3], "w").write(src)
print(cfg.gpu_spec.nvcc_arch)
"""

# Packs Params with fake pointers: every tensor's data_ptr() is a distinct integer, no CUDA needed.
_PACK = r"""
import dataclasses, itertools, sys, types
from trtllm_mk.config import load_config
from trtllm_mk.schedule import Schedule
from trtllm_mk.codegen import generate_source
from trtllm_mk.runtime import megakernel as mkm
cfg = load_config(sys.argv[1])
schedule = Schedule.load(sys.argv[2])
_, layout = generate_source(schedule, cfg.kv_cache_config.tokens_per_block, cfg.max_seq_len, cfg.gpu_spec.has_tma)
class Fake:
    def __init__(self, ptr, shape=(1,)):
        self.ptr, self.shape = ptr, shape
    def data_ptr(self):
        return self.ptr
n = itertools.count(0x1000, 0x100)   # a mixture-of-experts model has tens of thousands of tensors
spec = schedule.spec
weights = {name: Fake(next(n)) for name in sorted(spec.expected_tensors())}
d = object.__new__(mkm.MegakernelDecoder)
d.spec, d.schedule, d.layout, d.batch = spec, schedule, layout, schedule.batch
d.weights = weights
d.cache = types.SimpleNamespace(pool=Fake(next(n), (spec.num_layers, 77, 2, 1, 1, 1)), block_table=Fake(next(n), (1, 129)))
d.inv_freq = Fake(next(n))
moe_only = {"router_logits", "moe_slot", "moe_w", "moe_act", "moe_xn", "router_acc", "expert_sum"}   # null in a dense model's kernel
d.buf = types.SimpleNamespace(**{f.name: None if f.name in moe_only and not spec.is_moe else Fake(next(n))
                                 for f in dataclasses.fields(mkm.DecodeBuffers)})
d._layer_table = Fake(next(n))
d._scale_table = None
d.rank, d._peer_table = 0, None   # one GPU (tensor parallelism: MegakernelDecoder.connect)
d._routers, d._experts = (Fake(next(n)), Fake(next(n))) if spec.is_moe else (None, None)   # the expert tables
d._router_o = Fake(next(n)) if spec.is_moe and schedule.plan.expert_fused else None   # the router through o_proj
for trace in (None, Fake(next(n))):
    d._trace = trace
    sys.stdout.write(d._pack_params().hex() + "\n")
"""


def run_py(tree: Path, code: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: python failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def arch_flags(arch: str) -> list[str]:
    return ["-gencode", "arch=compute_90a,code=sm_90a"] if arch == "sm_90a" else [f"-arch={arch}"]


def ptx(src: Path, arch: str) -> list[str]:
    out = src.with_suffix(".ptx")
    proc = subprocess.run(["nvcc", "-ptx", "-std=c++17", "-O3", *arch_flags(arch), "-o", str(out), str(src)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"nvcc failed on {src}:\n{proc.stderr[-3000:]}")
    keep = []
    for line in out.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("//") or s.startswith(".loc") or s.startswith(".file"):
            continue
        # nvcc names file-local symbols after the source file (_INTERNAL_<hash>_<n>_<file>_cu_<hash>)
        keep.append(re.sub(r"_INTERNAL_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "_INTERNAL_", re.sub(r"\s*//.*$", "", line)))
    return keep


def _params_extend(ref_hex: str, new_hex: str) -> bool:
    """The new Params bytes equal the reference's, or extend them with null fields only (fields appended
    at the end keep older kernels running on the new runtime)."""
    return new_hex.startswith(ref_hex) and set(new_hex[len(ref_hex):]) <= {"0"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", type=Path, required=True, help="reference source tree (searches the schedules)")
    ap.add_argument("--new", type=Path, default=Path("."), help="tree under test")
    ap.add_argument("--configs", nargs="*", help="deployment YAMLs (default: the reference tree's configs/*.yaml)")
    ap.add_argument("--budget", type=float, default=10.0, help="search budget per config, seconds")
    ap.add_argument("--work", type=Path, help="keep schedules, sources and PTX here (default: a temp dir)")
    ap.add_argument("--no-ptx", action="store_true", help="compare the Params packing only")
    a = ap.parse_args()
    ref, new = a.ref.resolve(), a.new.resolve()
    configs = [Path(c).resolve() for c in a.configs] if a.configs else sorted((ref / "configs").glob("*.yaml"))
    work = a.work or Path(tempfile.mkdtemp(prefix="mk_equiv_"))
    work.mkdir(parents=True, exist_ok=True)
    bad = 0
    for cfg in configs:
        d = work / cfg.stem
        d.mkdir(exist_ok=True)
        sched = d / "schedule.json"
        if not sched.exists():
            run_py(ref, _SEARCH, str(cfg), str(sched), str(a.budget))
        pr = run_py(ref, _PACK, str(cfg), str(sched))
        pn = run_py(new, _PACK, str(cfg), str(sched))
        same_params = all(_params_extend(a, b) for a, b in zip(pr.split(), pn.split()))
        status = ["params " + ("same" if pr == pn else "same, appended fields null" if same_params else "DIFFERENT")]
        bad += not same_params
        if not a.no_ptx:
            arch = run_py(ref, _GENERATE, str(cfg), str(sched), str(d / "ref.cu")).strip()
            run_py(new, _GENERATE, str(cfg), str(sched), str(d / "new.cu"))
            r, n = ptx(d / "ref.cu", arch), ptx(d / "new.cu", arch)
            same = r == n
            bad += not same
            status.append(f"ptx {arch} " + ("same" if same else "DIFFERENT") + f" ({len(n)} lines)")
            if not same:
                print("\n".join(list(difflib.unified_diff(r, n, "ref", "new", lineterm="", n=2))[:60]))
        print(f"{cfg.name}: " + ", ".join(status), flush=True)
    print(json.dumps({"work": str(work), "configs": len(configs), "different": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
