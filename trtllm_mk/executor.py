"""CPU executor: runs a schedule's task graph with PyTorch CPU ops on real weights, task by task, on
the same event machine as the megakernel. It is the ``--simulate`` decode path of machines without a
GPU, and the check that a schedule computes the model: its logits must equal the reference decoder's
under any legal interleaving.

Every task does exactly what the ``graph.tasks`` docstring says, on the same buffers and with the same
rounding points as the GPU: weights are bf16 (rounded once at load; a 4-bit model's layer linears exact
in fp32), GEMV inputs (the normed x, attn_out, act) are rounded to bf16, accumulation is fp32, k and v
are rounded to bf16 as they are stored in the paged cache, and each task touches only the rows, heads
and splits it owns.
"""
from __future__ import annotations

import random
from typing import Callable

import torch

from .graph import Kind, StepGraph, Task
from .kinds.argmax import NonFiniteLogits  # noqa: F401  (raised by ARGMAX; re-exported for callers)
from .kv_cache import PagedKVCache
from .model.rope import rope_inv_freq
from .model.spec import ModelSpec
from .residual import from_fixed
from .schedule import Schedule
from .seam import MAX_TOP_LOGPROBS
from .verify import ScheduleError, check


INTERLEAVES = ("round_robin", "random", "sequential")


class EventMachine:
    """The megakernel's execution model without the arithmetic: one in-order program per SM, event
    counters that are never reset (a wait passes at ``count * (steps_done + 1)``)."""

    def __init__(self, schedule: Schedule, graph: StepGraph):
        self.graph = graph
        self.offsets = graph.counter_offsets()
        n = sum(ev.rows * ev.slots for ev in graph.events.values())
        self.counts = [0] * n
        for name, ev in graph.events.items():
            for row in range(ev.rows):
                for slot in range(ev.slots):
                    self.counts[self._index((name, row, slot))] = ev.counts[row][slot]
        self.counters = [0] * n
        self.steps_done = 0
        # per SM: (task, layer, wait counter indices, signal counter indices)
        self.programs: list[list[tuple[Task, int, list[int], list[int]]]] = []
        for sm in range(schedule.num_sms):
            prog = []
            for task, layer in schedule.unrolled(sm, graph):
                waits = [self._index(graph.resolve(task, layer, r)) for r in task.waits]
                signals = [self._index(graph.resolve(task, layer, r)) for r in task.signals]
                prog.append((task, layer, waits, signals))
            self.programs.append(prog)

    def _index(self, key: tuple[str, int, int]) -> int:
        name, row, slot = key
        ev = self.graph.events[name]
        if not (0 <= row < ev.rows and 0 <= slot < ev.slots):
            raise ScheduleError(f"event reference {name}[{row}][{slot}] outside its [{ev.rows}, {ev.slots}] tensor")
        return self.offsets[name] + row * ev.slots + slot

    def _ready(self, waits: list[int]) -> bool:
        k = self.steps_done + 1
        c, n = self.counters, self.counts
        return all(c[i] >= n[i] * k for i in waits)

    def run(self, execute: Callable[[Task, int], None] | None = None, interleave: str = "round_robin",
            seed: int = 0) -> list[tuple[int, int]]:
        """Run one step; ``execute(task, layer)`` does the work. Returns the (sm, position) order in
        which tasks ran. Raises ScheduleError if the machine gets stuck or a counter ends the step off
        its target (a slot signalled more or less often than its count)."""
        if interleave not in INTERLEAVES:
            raise ValueError(f"interleave={interleave!r}; choose one of {', '.join(INTERLEAVES)}")
        ptr = [0] * len(self.programs)
        trace: list[tuple[int, int]] = []
        remaining = sum(len(p) for p in self.programs)

        def advance(sm: int) -> bool:
            prog = self.programs[sm]
            if ptr[sm] >= len(prog):
                return False
            task, layer, waits, signals = prog[ptr[sm]]
            if not self._ready(waits):
                return False
            if execute is not None:
                execute(task, layer)
            for i in signals:
                self.counters[i] += 1
            trace.append((sm, ptr[sm]))
            ptr[sm] += 1
            return True

        rng = random.Random(seed)
        sms = range(len(self.programs))
        while remaining:
            before = remaining
            if interleave == "round_robin":        # each SM advances at most one task per round
                remaining -= sum(advance(sm) for sm in sms)
            elif interleave == "sequential":       # each SM runs as far as it can, in SM order
                for sm in sms:
                    while advance(sm):
                        remaining -= 1
            else:
                runnable = [sm for sm in sms if ptr[sm] < len(self.programs[sm])
                            and self._ready(self.programs[sm][ptr[sm]][2])]
                if runnable:
                    advance(rng.choice(runnable))
                    remaining -= 1
            if remaining == before:
                raise ScheduleError(f"deadlock at step {self.steps_done}: {self._stuck(ptr)}")
        self.steps_done += 1
        self._check_targets()
        return trace

    def _name(self, i: int) -> str:
        for name, off in sorted(self.offsets.items(), key=lambda kv: -kv[1]):
            if i >= off:
                slots = self.graph.events[name].slots
                return f"{name}[{(i - off) // slots}][{(i - off) % slots}]"
        raise AssertionError(i)

    def _stuck(self, ptr: list[int]) -> str:
        k = self.steps_done + 1
        parts = []
        for sm, prog in enumerate(self.programs):
            if ptr[sm] < len(prog):
                task, layer, waits, _ = prog[ptr[sm]]
                blocked = [i for i in waits if self.counters[i] < self.counts[i] * k]
                what = f"layer {layer} {task.label()}" if layer >= 0 else task.label()
                on = ", ".join(f"{self._name(i)} at {self.counters[i] - self.counts[i] * (k - 1)} of "
                               f"{self.counts[i]}" for i in blocked)
                parts.append(f"SM {sm} task {ptr[sm]} ({what}) waits {on}")
        return "; ".join(parts)

    def _check_targets(self) -> None:
        k = self.steps_done
        for i, (c, n) in enumerate(zip(self.counters, self.counts)):
            if c != n * k:
                raise ScheduleError(f"after step {k - 1}, counter {self._name(i)} is {c} but its target is "
                                    f"{n * k}: the slot was signalled {c - n * (k - 1)} times, its count is {n}")


def _shape_of(spec: ModelSpec) -> dict:
    """What a schedule depends on: everything but the model's name and end tokens."""
    return {k: v for k, v in spec.to_dict().items() if k not in ("name", "eos_token_ids")}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """The rounding the GPU applies when it stages an activation (or stores a weight) as bf16."""
    return t.to(torch.bfloat16).to(torch.float32)


class CpuExecutor:
    """Decode steps of ``schedule`` on the CPU, with ``weights`` (HF names) and a paged KV cache."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], schedule: Schedule,
                 cache: PagedKVCache, validate: bool = True, round_activations: bool = True):
        """``round_activations=False`` skips the bf16 rounding of GEMV inputs and of the new k/v
        (weights stay bf16): with an fp32 cache the step is then exact fp32 arithmetic, which lets
        tests compare the task semantics with a dense computation far below bf16 noise."""
        if _shape_of(schedule.spec) != _shape_of(spec):
            raise ScheduleError(f"schedule was built for model {schedule.spec.name!r}, not {spec.name!r}")
        self.spec, self.schedule, self.cache = spec, schedule, cache
        self.stage_round = _bf16 if round_activations else (lambda t: t)
        self.graph = schedule.graph()
        if validate:
            check(schedule, self.graph)
        missing = [n for n in spec.expected_tensors() if n not in weights]
        if missing:
            raise ValueError(f"weights: missing {missing[0]} (+{len(missing) - 1} more)")
        dm = self.graph.dims
        self.B, self.H, self.d, self.G, self.S = dm.batch, dm.hidden, dm.head_dim, dm.group, dm.splits
        self.nkv, self.GR, self.eps = dm.kv_heads, dm.group_rows, spec.rms_norm_eps
        self._pack(weights)
        self.inv_freq = rope_inv_freq(spec)
        B, f32, i32 = self.B, torch.float32, torch.int32
        self.x = torch.zeros(B, self.H, dtype=torch.int64)   # fixed point (trtllm_mk/residual.py)
        self.qkv = torch.zeros(B, dm.qkv_rows, dtype=f32)
        self.part_o = torch.zeros(B, self.nkv, self.S, self.G, self.d, dtype=f32)
        self.part_ml = torch.zeros(B, self.nkv, self.S, self.G, 2, dtype=f32)
        self.attn_out = torch.zeros(B, dm.q_dim, dtype=f32)
        self.act = torch.zeros(B, dm.intermediate, dtype=f32)
        self.logits = torch.zeros(B, dm.vocab, dtype=f32)
        # one rank of a tensor-parallel model (parallel/cpu_executor.py shares x, lm_val and lm_idx
        # between the ranks and sets rank); alone, rank 0 of 1
        self.tp, self.rank = dm.tensor_parallel, 0
        self.lm_val = torch.zeros(B, self.tp * dm.n_lm_tiles, dtype=f32)
        self.lm_idx = torch.zeros(B, self.tp * dm.n_lm_tiles, dtype=i32)
        # mixture of experts: the router's logits, each expert slot's expert and per-row weight
        # (ROUTE), each slot's activation (EGATEUP) and the experts' normed input (ROUTER)
        nslot = dm.expert_slots
        self.router_logits = torch.zeros(B, dm.experts, dtype=f32)
        self.moe_slot = torch.full((nslot,), -1, dtype=i32)
        self.moe_w = torch.zeros(nslot, B, dtype=f32)
        self.moe_act = torch.zeros(nslot, B, dm.intermediate, dtype=f32)
        self.moe_xn = torch.zeros(B, dm.hidden, dtype=f32)   # the normed rows ROUTER publishes
        # under TilePlan.expert_fused (kinds/router.py): each layer's router logits summed in fixed point along
        # the attention chain, and row l + 1 of expert_sum layer l's experts' outputs, beside x
        self.router_acc = torch.zeros(dm.layers, B, dm.experts, dtype=torch.int64)
        self.expert_sum = torch.zeros(dm.layers + 1, B, dm.hidden, dtype=torch.int64)
        self.tokens = torch.zeros(B, dtype=i32)
        self.pos = torch.zeros(B, dtype=i32)
        self.history = torch.full((B, cache.max_seq_len), -1, dtype=i32)
        # how each row chooses its token (None: greedy), as the kernel's SamplingSlot; ARGMAX's outputs
        self.sampling: list = [None] * B
        self.logprobs = torch.zeros(B, 1 + MAX_TOP_LOGPROBS, dtype=f32)
        self.top_ids = torch.zeros(B, MAX_TOP_LOGPROBS, dtype=i32)
        self.machine = EventMachine(schedule, self.graph)
        self._run = {k: k.module.execute for k in Kind}

    def _pack(self, w: dict[str, torch.Tensor]) -> None:
        """bf16 weights as fp32 tensors; q/k/v packed once into the grouped QKV row order. A 4-bit
        model's layer linears are the kernel's exact fp32 weights (``quant.kernel_layout.dequantize``:
        its consumers scale a group's sums, they never round a weight to bf16)."""
        spec, G, d = self.spec, self.G, self.d
        lin = (lambda t: t.to(torch.float32)) if spec.weight_bits == 4 else _bf16
        self.embed = _bf16(w["model.embed_tokens.weight"])
        self.final_norm = _bf16(w["model.norm.weight"])
        self.lm_head = _bf16(w["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"])
        self.layers = []
        self.experts: list[list[dict[str, torch.Tensor]]] = []   # per sparse layer, per expert
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            def grouped(kind: str) -> torch.Tensor:   # rows of group g: its G q heads, k_g, v_g
                q, k, v = (w[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
                return torch.cat([part for g in range(self.nkv) for part in
                                  (q[g * G * d:(g + 1) * G * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d])])

            lw = {"qkv": lin(grouped("weight")), "qkv_bias": _bf16(grouped("bias")) if spec.qkv_bias else None,
                  "o": lin(w[p + "self_attn.o_proj.weight"]),
                  "ln1": _bf16(w[p + "input_layernorm.weight"]),
                  "ln2": _bf16(w[p + "post_attention_layernorm.weight"])}
            if spec.is_moe_layer(i):   # the router, and each expert's gate, up and down (kinds/route.py)
                router, experts = spec.moe_names(i)
                lw["router"] = _bf16(w[router])
                self.experts.append([{"gate": _bf16(w[g]), "up": _bf16(w[u]), "down": _bf16(w[d])}
                                     for g, u, d in experts])
            else:
                lw.update(gate=lin(w[p + "mlp.gate_proj.weight"]), up=lin(w[p + "mlp.up_proj.weight"]),
                          down=lin(w[p + "mlp.down_proj.weight"]))
            if spec.qk_norm:
                lw["q_norm"] = _bf16(w[p + "self_attn.q_norm.weight"])
                lw["k_norm"] = _bf16(w[p + "self_attn.k_norm.weight"])
            self.layers.append(lw)

    @property
    def vocab_base(self) -> int:
        """The first token id of this rank's vocabulary shard."""
        return self.rank * self.graph.dims.vocab

    @property
    def lm_tile_base(self) -> int:
        """This rank's first column of lm_val / lm_idx."""
        return self.rank * self.graph.dims.n_lm_tiles

    # ------------------------------------------------------------------ stepping
    def set_sampling(self, row: int, params) -> None:
        """How ``row`` chooses its tokens from the next step on (``SamplingParams`` or None: greedy)."""
        self.sampling[row] = params

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, interleave: str = "round_robin",
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: ``tokens[b]`` sits at position ``pos[b]`` (= tokens already cached).
        Returns (logits [B, V] fp32, next tokens [B] int32); afterwards ``self.pos`` is ``pos + 1``."""
        tokens = torch.as_tensor(tokens).to(torch.int32).reshape(-1)
        pos = torch.as_tensor(pos).to(torch.int32).reshape(-1)
        if tokens.numel() != self.B or pos.numel() != self.B:
            raise ValueError(f"tokens and pos must have {self.B} entries (the schedule's batch)")
        if int(pos.min()) < 0 or int(pos.max()) >= self.cache.max_seq_len:
            raise ValueError(f"pos {pos.tolist()} outside the KV cache's 0..{self.cache.max_seq_len - 1}")
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        self.machine.run(self._execute, interleave, seed)
        return self.logits.clone(), self.tokens.clone()

    def _execute(self, task: Task, layer: int) -> None:
        self._run[task.kind](self, task, layer)

    # ------------------------------------------------------------------ helpers of the kinds
    # (each kind's semantics is its module's ``execute(ex, task, layer)`` in trtllm_mk.kinds)
    def norm_staged(self, w: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        """rmsnorm(x) * w as staged; ``pending``: fixed-point outputs that belong to x but are kept beside
        it (expert_sum), added exactly first."""
        x = from_fixed(self.x if pending is None else self.x + pending)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.stage_round(x * rstd * w)

    def head_norm(self, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def merged_attention(self, g: int) -> torch.Tensor:
        """Group g's attention output [B, G*d], merged from its S split partials (COMBINE's merge;
        OPROJ's under TilePlan.o_merge)."""
        m, l = self.part_ml[:, g, :, :, 0], self.part_ml[:, g, :, :, 1]     # [B, S, G]
        M = m.max(1, keepdim=True).values
        f = torch.exp(m - M)                   # empty splits have m = -inf: weight 0
        num = (f[..., None] * self.part_o[:, g]).sum(1)                   # [B, G, d]
        den = (f * l).sum(1)[..., None]
        return (num * (1.0 / den)).reshape(self.B, self.G * self.d)   # the kernel's one division per head
