"""Grid of the quantized constants against benchmarks/results/h200_v44_2026-11-30/model_fit/measured_w4a16.json."""
import itertools, json, sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, ".")
from benchmarks.calibrate import measured_entries, schedule_of
from trtllm_mk.gpus import get_gpu
from trtllm_mk.search import load_calibration, predict
path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200_v44_2026-11-30/model_fit/measured_w4a16.json")
gpu = get_gpu("H200")
cal0 = load_calibration(gpu)
entries = measured_entries(json.loads(path.read_text()))
# list-scheduled entries are scheduled once, under the file's constants (as measured)
wl = [(e, schedule_of(e, gpu, cal0, path), e["measured_us"]) for e in entries]
def preds(cal):
    c = cal.resolved(gpu)
    return [predict(s, gpu, c).step_us for _, s, _ in wl]
def pairs_wrong(p):
    bad = 0
    for i, j in itertools.combinations(range(len(wl)), 2):
        ei, ej = wl[i][0], wl[j][0]
        if ei["model"] != ej["model"] or ei["batch"] != ej["batch"]: continue
        mi, mj = wl[i][2], wl[j][2]
        if abs(mi / mj - 1) < 0.01: continue
        if (p[i] - p[j]) * (mi - mj) < 0: bad += 1
    return bad
def report(cal, tag):
    p = preds(cal)
    errs = [pi / m - 1 for pi, (_, _, m) in zip(p, wl)]
    rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
    print(f"{tag}: rms {100*rms:.1f}% max {100*max(map(abs, errs)):.1f}% wrong pairs {pairs_wrong(p)}")
    return p, errs, rms
if __name__ == "__main__":
    p, errs, _ = report(cal0, "now")
    for (e, s, m), pi, er in zip(wl, p, errs):
        print(f"  {e['model'][-40:]:40s} b{e['batch']} {s.plan.stages}x{s.plan.slot_bytes//1024}K dks{s.plan.down_ksplit} {m:8.1f} {pi:8.1f} {100*er:+6.1f}%")
    best = []
    for qt in [0.2, 0.4, 0.8, 1.4]:
        for qs in [0.05, 0.15, 0.25, 0.35, 0.5]:
            for qc in [0.6, 0.8, 1.0, 1.3]:
                cal = replace(cal0, quant_task_overhead_us=qt or 1e-9, quant_slot_overhead_us=qs, quant_consumer_cost=qc)
                p = preds(cal)
                errs = [pi / m - 1 for pi, (_, _, m) in zip(p, wl)]
                rms = (sum(e * e for e in errs) / len(errs)) ** 0.5
                best.append((pairs_wrong(p), rms, max(map(abs, errs)), qt, qs, qc))
    best.sort()
    for b in best[:15]:
        print("wrong %d rms %.1f%% max %.1f%%  qt %.2f qs %.2f qc %.2f" % (b[0], 100*b[1], 100*b[2], *b[3:]))
    b = best[0]
    cal = replace(cal0, quant_task_overhead_us=b[3], quant_slot_overhead_us=b[4], quant_consumer_cost=b[5])
    p, errs, _ = report(cal, "best")
    for (e, s, m), pi, er in zip(wl, p, errs):
        print(f"  {e['model'][-40:]:40s} b{e['batch']} {s.plan.stages}x{s.plan.slot_bytes//1024}K dks{s.plan.down_ksplit} {m:8.1f} {pi:8.1f} {100*er:+6.1f}%")
