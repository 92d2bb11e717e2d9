"""Decode latency of every system over a matrix of model shapes x batch x context, in one run.

    python -m benchmarks.decode_latency --out DIR [--models llama-3.2-1b qwen3-8b] [--batch 1 4]
        [--context 128 512 2048 8192] [--systems torch.compile eager+cudagraph] [--steps 100]
        [--plugin MODULE]          # a module that calls benchmarks.baselines.register_system(...)
    python -m benchmarks.decode_latency --out DIR --cpu-smoke   # tiny model on the CPU, for tests
    python -m benchmarks.decode_latency --out DIR --merge A/report.json B/report.json  # runs made in parts
    python -m benchmarks.decode_latency --out DIR --weights w4a16 [--group 128] --plugin benchmarks.megakernel_system

--weights w4a16: the decoder-layer linears are round-to-nearest quantized to 4 bits in groups of
``--group`` input columns (benchmarks/w4a16_weights.py; embeddings, norms, LM head bf16); the model is
named ``<model>:w4a16-g<group>`` in the report, and the floor counts the 4-bit bytes. Default systems:
the int4 baseline (torch's tinygemm kernel under torch.compile, benchmarks/int4_baseline.py), the bf16
torch.compile decoder on the same (dequantized) weights, and the --plugin systems, which get the
quantized weights.
--weights fp8: e4m3 decoder-layer linears with one fp32 scale per output row (``<model>:fp8``); the
baseline is gpt-fast's weight-only form under torch.compile (benchmarks/fp8_baseline.py).

Models have random bf16 weights with the real shapes (configs/models/<name>.json). Per config
(model, batch, context) and system: the per-token decode time (TPOT) over ``--steps`` steps after
warm-up, and its distance to the floor, the time to read every weight once (of a sparse model the
router and the experts the rows select: k per layer at batch 1, the expected distinct ones above) plus
the KV cache of the context at the read bandwidth measured at the start of the same run. TTFT is the prefill of
``context`` tokens per row by the static-cache baseline decoder (eager, SDPA): the prefill path all
systems share in the hybrid engine. A system that fails is recorded with its error, never fatal.

Output in --out: report.json (trtllm-bench style names: tpot_ms {avg,p50,p90,p95,p99}, ttft_ms,
tokens_per_sec_per_user, ...), report.md, latency_vs_context.png; all three rewritten after every
config, so a run cut short still leaves its results.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.metadata
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from trtllm_mk.errors import UserError, run_cli  # noqa: E402
from trtllm_mk.model.decoder_block import share_fused_storage  # noqa: E402
from trtllm_mk.model.random_weights import random_weights  # noqa: E402
from trtllm_mk.model.registry import resolve_model  # noqa: E402
from trtllm_mk.model.spec import ModelSpec, spec_from_hf_config  # noqa: E402

from .baselines import SYSTEMS, StaticCacheDecoder, cache_len, measure_read_bandwidth, random_prompt  # noqa: E402
from .baselines import free_memory, setup_system  # noqa: E402
from .regress import config_name  # noqa: E402
from .timing import time_steps  # noqa: E402

SCHEMA = "trtllm_mk.decode_latency/1"
DEFAULT_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b")
DEFAULT_BATCH = (1, 4)
DEFAULT_CONTEXT = (128, 512, 2048, 8192)
MIN_STEPS = 100
WEIGHT_FORMATS = ("bf16", "w4a16", "fp8")
W4A16_GROUP = 128
# --weights w4a16 times these (and the --plugin systems) unless --systems says otherwise
W4A16_SYSTEMS = ("torch.compile int4", "torch.compile")
FP8_SYSTEMS = ("torch.compile fp8", "torch.compile")   # --weights fp8 likewise
TTFT_REPS = 3
SMOKE_MODEL = "tiny-llama"  # --cpu-smoke only: trtllm_mk.model.tiny's llama shapes
SMOKE = {"models": [SMOKE_MODEL], "batch": [1, 2], "context": [16, 32], "steps": 5, "warmup": 2}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def resolve_spec(name: str) -> ModelSpec:
    if name == SMOKE_MODEL:
        from trtllm_mk.model.tiny import tiny_config
        return spec_from_hf_config(tiny_config("llama"), name=SMOKE_MODEL)
    return resolve_model(name).spec


def decode_weight_bytes(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> int:
    """Bytes of weights one decode step reads: all of them, except an untied embedding table
    (only B rows of it are looked up)."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if not spec.tie_word_embeddings:
        emb = weights["model.embed_tokens.weight"]
        total -= emb.numel() * emb.element_size()
    return total




def _error(e: BaseException) -> dict[str, Any]:
    first = (str(e).strip().splitlines() or [""])[0]
    return {"status": "error", "error": f"{type(e).__name__}: {first}"[:400],
            "traceback": traceback.format_exc()[-4000:]}


def measure_ttft(spec, weights, batch: int, context_len: int, device: torch.device) -> dict[str, Any]:
    dec = StaticCacheDecoder(spec, weights, batch, cache_len(context_len))
    prompt = random_prompt(spec, batch, context_len, device)
    stats = time_steps(lambda: dec.prefill(prompt), steps=TTFT_REPS, warmup=1, device=device)
    del dec
    return {"ttft_ms": stats.p50, "ttft": stats.to_dict()}


def run_system(name: str, spec, weights, batch: int, context_len: int, device: torch.device, steps: int,
               warmup: int, floor: float, env: dict[str, Any]) -> dict[str, Any]:
    run = None
    try:
        t0 = time.perf_counter()
        run = setup_system(name, spec, weights, batch, context_len, device)
        setup_s = time.perf_counter() - t0
        stats = time_steps(run.step, steps=steps, warmup=warmup, device=device)
        return {
            "status": "ok",
            "tpot_ms": stats.to_dict(),
            "tokens_per_sec_per_user": 1e3 / stats.p50,
            "tokens_per_sec": batch * 1e3 / stats.p50,
            "floor_ms": floor,
            "fraction_of_floor": floor / stats.p50,
            "setup_s": round(setup_s, 2),
            "info": dict(run.info),
            "device": env["device"], "date": _now(), "torch_version": env["torch_version"],
        }
    except Exception as e:  # a failing system (compile error, OOM, ...) is a result, not a crash
        return _error(e)
    finally:
        if run is not None:
            try:
                run.close()
            except Exception:  # noqa: BLE001 - cleanup must not hide the measurement
                pass
        del run
        free_memory()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def environment(device: torch.device) -> dict[str, Any]:
    env = {"date": _now(), "torch_version": torch.__version__,
           "transformers_version": importlib.metadata.version("transformers"),
           "cuda_version": torch.version.cuda, "host": platform.node()}
    if device.type == "cuda":
        from trtllm_mk.errors import ConfigError
        from trtllm_mk.gpus import detect_gpu
        env["device"] = torch.cuda.get_device_name(device)
        try:
            env["gpu"] = detect_gpu().name  # catalog name: selects benchmarks/baselines/<gpu>.json
        except ConfigError:
            env["gpu"] = env["device"].replace(" ", "_")
    else:
        env["device"] = platform.processor() or "cpu"
        env["gpu"] = "cpu"
    return env


def measure_config(spec, weights, model: str, batch: int, ctx: int, systems, bw: float, steps: int, warmup: int,
                   device: torch.device, env: dict[str, Any], bar) -> dict[str, Any]:
    # quantized: the bytes the kernel streams (codes and scale words), not the dequantized dict's;
    # mixture of experts: the router and the experts the rows select (expected distinct experts at
    # batch > 1), not every expert of the dict
    wbytes = (spec.decode_weight_bytes(batch) if spec.quantized or spec.is_moe
              else decode_weight_bytes(spec, weights))
    kv = batch * ctx * spec.kv_bytes_per_token(weights["model.norm.weight"].element_size())
    floor = (wbytes + kv) / bw * 1e3
    cfg: dict[str, Any] = {"name": config_name(model, batch, ctx), "model": model, "batch": batch,
                           "context_len": ctx, "weight_bytes": wbytes, "kv_bytes": kv, "floor_ms": floor,
                           "systems": {}}
    bar.set_postfix_str(f"{cfg['name']}: ttft")
    try:
        cfg.update(measure_ttft(spec, weights, batch, ctx, device))
    except Exception as e:
        cfg.update(ttft_ms=None, ttft_error=_error(e)["error"])
    free_memory()
    bar.update()
    for name in systems:
        bar.set_postfix_str(f"{cfg['name']}: {name}")
        res = run_system(name, spec, weights, batch, ctx, device, steps, warmup, floor, env)
        if res["status"] == "ok":
            res["ttft_ms"] = cfg["ttft_ms"]
        cfg["systems"][name] = res
        bar.update()
    return cfg


def weights_label(model: str, weights: str, group: int) -> str:
    """The model's name in the report: quantized runs are another model than the bf16 one."""
    if weights == "fp8":
        return f"{model}:fp8"
    return model if weights == "bf16" else f"{model}:{weights}-g{group}"


def format_spec(spec: ModelSpec, weights: str, group: int) -> ModelSpec:
    """``spec`` with its decoder-layer linears in the ``weights`` format ("bf16": ``spec`` itself)."""
    if weights == "bf16":
        return spec
    from .w4a16_weights import fp8_spec, w4a16_spec
    return fp8_spec(spec) if weights == "fp8" else w4a16_spec(spec, group)


def label_spec(label: str) -> ModelSpec:
    """The spec a report's model name (``weights_label``) stands for: ``<model>``, ``<model>:fp8`` or
    ``<model>:w4a16-g<group>``."""
    model, _, weights = label.partition(":")
    fmt, _, group = weights.partition("-g")
    if weights and not (weights == "fp8" or (fmt == "w4a16" and group.isdigit())):
        raise UserError(f"model '{label}': expected <model>, <model>:fp8 or <model>:w4a16-g<group>")
    return format_spec(resolve_spec(model), fmt or "bf16", int(group or 0))


def model_weights(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int, weights: str, group: int):
    """(spec, weights) the systems decode: the bf16 random model, or its W4A16 or FP8 form."""
    if weights == "bf16":
        w = random_weights(spec, device, dtype, seed)
        # a mixture-of-experts model's experts stacked once, in place: the baselines' decoders read
        # them without a copy (61 GB of Qwen3-30B-A3B leave no room for a second one on an H100)
        return spec, share_fused_storage(spec, w) if spec.is_moe else w
    from .w4a16_weights import w4a16_weights
    spec = format_spec(spec, weights, group)
    return spec, w4a16_weights(spec, device, dtype, seed)


def run_benchmark(models, batches, contexts, systems, steps: int, warmup: int, device: torch.device,
                  dtype: torch.dtype, seed: int, on_update=lambda report, model_done: None,
                  weights_format: str = "bf16", group: int = W4A16_GROUP) -> dict[str, Any]:
    """Measure every (model, batch, context, system); ``on_update(report, model_done)`` is called
    after each config (and with model_done=True after each model's last one). ``weights_format``:
    "bf16", "w4a16" (4-bit decoder-layer linears in groups of ``group`` columns) or "fp8" (e4m3 ones)."""
    env = environment(device)
    report: dict[str, Any] = {"schema": SCHEMA, "kind": "measured", **env, "dtype": str(dtype).removeprefix("torch."),
                              "steps": steps, "warmup": warmup, "seed": seed, "systems": list(systems),
                              "configs": []}
    if weights_format == "fp8":
        report["weights"] = {"format": "fp8", "quantization": "e4m3 decoder-layer linears, one fp32 scale per output "
                                                              "row; embeddings, norms and LM head bf16"}
    elif weights_format != "bf16":
        report["weights"] = {"format": weights_format, "group": group,
                             "quantization": "symmetric round-to-nearest 4-bit decoder-layer linears; embeddings, "
                                             "norms and LM head bf16"}
    # no_grad rather than inference_mode: tensors made under inference_mode are a rarely trodden
    # path for torch.compile and CUDA graphs; no_grad is what gpt-fast style baselines use.
    with torch.no_grad():
        report["read_bandwidth"] = measure_read_bandwidth(device)
        bw = report["read_bandwidth"]["bytes_per_s"]
        per_model = len(batches) * len(contexts) * (len(systems) + 1)
        bar = tqdm(total=len(models) * per_model, file=sys.stderr, dynamic_ncols=True, desc="decode latency")
        for name in models:
            model = weights_label(name, weights_format, group)
            bar.set_postfix_str(f"{model}: random weights")
            try:
                spec, weights = model_weights(resolve_spec(name), device, dtype, seed, weights_format, group)
            except Exception as e:  # e.g. the model does not fit: every config of it fails, the run goes on
                err = _error(e)
                report["configs"] += [{"name": config_name(model, b, c), "model": model, "batch": b,
                                       "context_len": c, "floor_ms": None, "ttft_ms": None,
                                       "systems": {n: err for n in systems}} for b in batches for c in contexts]
                bar.update(per_model)
                free_memory()
                continue
            for batch in batches:
                for ctx in contexts:
                    report["configs"].append(measure_config(spec, weights, model, batch, ctx, systems, bw, steps,
                                                            warmup, device, env, bar))
                    on_update(report, False)
            del weights
            free_memory()
            if hasattr(torch, "_dynamo"):
                torch._dynamo.reset()  # compiled graphs of this model (and their memory pools) go too
            on_update(report, True)
        bar.close()
    return report


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _fmt(v, digits=3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def render_markdown(report: dict[str, Any]) -> str:
    bw = report.get("read_bandwidth", {})
    lines = [
        "# Decode latency",
        "",
        f"{report['device']} ({report['gpu']}), torch {report['torch_version']}, {report['date']}, "
        f"{report['dtype']} random weights, {report['steps']} timed steps after {report['warmup']} warm-up.",
        f"Read bandwidth: {bw.get('bytes_per_s', 0) / 1e12:.3f} TB/s ({bw.get('method', '?')}). "
        "Floor = (decode weight bytes + KV bytes of the context) / read bandwidth; "
        "% of floor = floor / TPOT p50 (100% = at the floor). "
        "TTFT: prefill of the context by the static-cache decoder (shared prefill path).",
        *([f"Weights: {report['weights']['format']}"
           + (f", group {report['weights']['group']}" if "group" in report["weights"] else "")
           + f" ({report['weights']['quantization']}); the floor counts the quantized bytes (codes and scales), "
           "bf16 systems decode the dequantized weights."] if report.get("weights") else []),
        "",
        "| model | batch | context | system | TPOT p50 ms | p90 | p99 | avg | tok/s/user | floor ms | % of floor "
        "| TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for c in report["configs"]:
        for name, r in c["systems"].items():
            if r["status"] != "ok":
                errors.append(f"- {c['name']} / {name}: {r['error']}")
                continue
            t = r["tpot_ms"]
            lines.append(f"| {c['model']} | {c['batch']} | {c['context_len']} | {name} | {t['p50']:.3f} | "
                         f"{t['p90']:.3f} | {t['p99']:.3f} | {t['avg']:.3f} | {r['tokens_per_sec_per_user']:.1f} | "
                         f"{c['floor_ms']:.3f} | {100 * r['fraction_of_floor']:.1f}% | {_fmt(c.get('ttft_ms'), 2)} |")
        if c.get("ttft_error"):
            errors.append(f"- {c['name']} / TTFT: {c['ttft_error']}")
    predicted = [(c, name, r) for c in report["configs"] for name, r in c["systems"].items()
                 if r["status"] == "ok" and r.get("info", {}).get("predicted_ms")]
    if predicted:
        lines += ["", "## Predicted (cost model at search time) vs measured", "",
                  "| model | batch | context | system | predicted ms | measured p50 ms | error |", "|---|---|---|---|---|---|---|"]
        for c, name, r in predicted:
            p, m = r["info"]["predicted_ms"], r["tpot_ms"]["p50"]
            lines.append(f"| {c['model']} | {c['batch']} | {c['context_len']} | {name} | {p:.3f} | {m:.3f} | "
                         f"{100 * (p / m - 1):+.1f}% |")
    if errors:
        lines += ["", "## Failed", "", *errors]
    return "\n".join(lines) + "\n"


def plot_latency_vs_context(report: dict[str, Any], path: Path) -> None:
    """One subplot per (model, batch): TPOT p50 vs context, one line per system, the floor dashed."""
    groups: dict[tuple[str, int], list[dict]] = {}
    models = list(dict.fromkeys(c["model"] for c in report["configs"]))   # first-seen order
    for c in sorted(report["configs"], key=lambda c: (models.index(c["model"]), c["batch"])):
        groups.setdefault((c["model"], c["batch"]), []).append(c)   # one row per model: batches side by side
    n = max(1, len(groups))
    ncols = min(2, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, ((model, batch), cfgs) in zip(axes.flat, groups.items()):
        cfgs = sorted(cfgs, key=lambda c: c["context_len"])
        ctxs = [c["context_len"] for c in cfgs]
        for i, name in enumerate(report["systems"]):  # color by system: the same in every subplot
            pts = [(c["context_len"], c["systems"][name]["tpot_ms"]["p50"]) for c in cfgs
                   if c["systems"].get(name, {}).get("status") == "ok"]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i % 10}", label=name)
        floor = [(c["context_len"], c["floor_ms"]) for c in cfgs if c.get("floor_ms") is not None]
        if floor:
            ax.plot(*zip(*floor), "k--", label="floor (read BW)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctxs, [str(x) for x in ctxs])
        ax.set_yscale("log")  # HF eager is ~50x the others: log keeps every line readable
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{model}, batch {batch}")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per decode step (p50)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(f"Decode latency vs context — {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs on the same device (a matrix measured in parts): configs by
    name, their systems merged (a later run's result for the same system wins). Each system keeps
    the floor of its own run; a config keeps the floor and TTFT of the first run that measured it."""
    devices = {r.get("device") for r in reports}
    if len(devices) != 1:
        raise UserError(f"--merge: reports come from different devices ({', '.join(map(str, devices))})")
    merged = {**reports[0], "configs": [], "merged_dates": [r["date"] for r in reports]}
    by_name: dict[str, dict] = {}
    systems: dict[str, None] = {}
    for r in reports:
        systems.update(dict.fromkeys(r["systems"]))
        for c in r["configs"]:
            if c["name"] in by_name:
                by_name[c["name"]]["systems"].update(c["systems"])
            else:
                by_name[c["name"]] = {**c, "systems": dict(c["systems"])}
                merged["configs"].append(by_name[c["name"]])
    merged["systems"] = list(systems)
    return merged


def write_outputs(report: dict[str, Any], out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    if plot:  # the slow one (~0.5 s): after each model, not after each config
        plot_latency_vs_context(report, out / "latency_vs_context.png")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def default_systems(weights: str, builtin: list[str]) -> list[str]:
    """Every registered system for bf16 weights; for w4a16 the int4 baseline, the bf16 torch.compile
    decoder and the systems registered beyond ``builtin`` (the --plugin ones)."""
    if weights == "bf16":
        return list(SYSTEMS)
    own = FP8_SYSTEMS if weights == "fp8" else W4A16_SYSTEMS
    return [*own, *(s for s in SYSTEMS if s not in builtin and s not in own)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_latency", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="REPORT",
                    help="measure nothing: merge report.json files of one device into --out")
    ap.add_argument("--models", nargs="+",
                    help=f"architectures in configs/models (default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--batch", nargs="+", type=int, help="batch sizes (default: 1 4)")
    ap.add_argument("--context", nargs="+", type=int, help="context lengths (default: 128 512 2048 8192)")
    ap.add_argument("--systems", nargs="+", help="systems to time (default: all registered)")
    ap.add_argument("--steps", type=int, help=f"timed decode steps per system (default and minimum: {MIN_STEPS})")
    ap.add_argument("--warmup", type=int, help="untimed steps before timing (default: 20)")
    ap.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                    help="import MODULE first (it registers more systems with register_system); repeatable")
    ap.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                    help="bf16 random weights, w4a16: 4-bit decoder-layer linears, or fp8: e4m3 ones with per-channel "
                         "scales (default: bf16)")
    ap.add_argument("--group", type=int, help=f"--weights w4a16: input columns per scale (default {W4A16_GROUP})")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model on the CPU in fp32, few steps: checks the harness, measures nothing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        reports = []
        for p in a.merge:
            try:
                reports.append(json.loads(p.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise UserError(f"--merge {p}: cannot read a report ({e})") from None
        write_outputs(merge_reports(reports), a.out)
        print(f"wrote {a.out / 'report.json'} ({len(reports)} runs merged)")
        return 0
    if a.group is not None and a.weights != "w4a16":
        raise UserError("--group applies to 4-bit quantized weights: add --weights w4a16")
    group = W4A16_GROUP if a.group is None else a.group
    if a.weights == "w4a16":
        from . import int4_baseline  # noqa: F401  (registers the int4 systems)
    if a.weights == "fp8":
        from . import fp8_baseline  # noqa: F401  (registers the FP8 systems)
    builtin = list(SYSTEMS)
    for mod in a.plugin:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise UserError(f"--plugin {mod}: cannot import it ({e})") from None
    if a.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)  # a tiny model gains nothing from threads; CI machines are shared
        d = SMOKE
    else:
        if not torch.cuda.is_available():
            raise UserError("decode_latency measures GPU decode latency and found no CUDA GPU; run it on the GPU "
                            "machine (or pass --cpu-smoke to check the harness on a tiny model)")
        device, dtype = torch.device(a.device), torch.bfloat16
        if device.type != "cuda":
            raise UserError(f"--device {a.device}: decode latency is measured on a CUDA device (or use --cpu-smoke)")
        d = {"models": list(DEFAULT_MODELS), "batch": list(DEFAULT_BATCH), "context": list(DEFAULT_CONTEXT),
             "steps": MIN_STEPS, "warmup": 20}
    models, batches = a.models or d["models"], a.batch or d["batch"]
    contexts, steps = a.context or d["context"], a.steps or d["steps"]
    warmup = d["warmup"] if a.warmup is None else a.warmup
    systems = a.systems or default_systems(a.weights, builtin)
    if not a.cpu_smoke and steps < MIN_STEPS:
        raise UserError(f"--steps {steps}: at least {MIN_STEPS} timed steps are needed for P99 to mean anything")
    if min(batches) < 1 or min(contexts) < 2 or warmup < 0:
        raise UserError("--batch must be >= 1, --context >= 2 and --warmup >= 0")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise UserError(f"--systems: unknown {', '.join(unknown)}; registered: {', '.join(SYSTEMS)} "
                        f"(more come from --plugin modules)")
    for m in models:  # fail before any measurement, not after an hour
        format_spec(resolve_spec(m), a.weights, group)
    run_benchmark(models, batches, contexts, systems, steps, warmup, device, dtype, a.seed,
                  on_update=lambda report, model_done: write_outputs(report, a.out, plot=model_done),
                  weights_format=a.weights, group=group)
    print(f"wrote {a.out / 'report.json'}, report.md, latency_vs_context.png")
    return 0


if __name__ == "__main__":
    run_cli(main)
