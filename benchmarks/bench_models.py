"""Model families taken through qsync-opt as a new user would: trace, solve, apply, train.

For every family (our built-ins, torch-native copies of torchvision/timm patterns, and
HuggingFace ``transformers`` models built from configs with random weights) it prints one
row of the table in docs/MODELS.md:

* full size (the published dimensions): ops, choosable ops, the share of the forward FLOPs
  in choosable ops, "other" ops holding more than 1% of the parameters or FLOPs (the
  tracer's warning), the time to trace, and the time to solve the allocation on
  ``v100x16+t4x16`` (HiGHS, a random monotone indicator: the indicator needs real batches,
  which at full size take minutes per model on this CPU);
* small size (the same code with fewer and narrower layers): a T4 plan that cycles every
  op through its menu (fp32, bf16, fp16, int8, int8_full, fp8 in turn; at these sizes a
  T4's estimated step is bound by kernel launches, so a solved plan stays all fp32) applied
  with ``apply_plan``, the calls each precision saw counted during one
  training step (a planned op that ran at another precision, or an unplanned op that ran
  at a lower one, is a failure), and three SGD steps on one synthetic batch with the model's
  default loss: the first and last loss (finite and falling is a pass).

    .venv/bin/python benchmarks/bench_models.py [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from qsync_opt.models.user import default_loss
from torch import nn

import qsync_opt as qs
from qsync_opt.documents.io import atomic_write_text
from qsync_opt.graph import unseen_ops
from qsync_opt.planner.solve import solve
from qsync_opt.problem.program import AllocationProblem, ProblemOptions
from qsync_opt.problem.synthetic import random_indicator
from qsync_opt.runtime import apply_plan, count_calls

# the torch-native copies of third-party patterns are test code (tests/support/patterns.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import patterns  # noqa: E402

CLUSTER = "v100x16+t4x16"
Builder = Callable[[bool], tuple[nn.Module, Any]]  # full -> (model, example_inputs)


# ----------------------------------------------------------------------------- families


def _builtin(name: str, small: Callable[[], tuple[nn.Module, Any]]) -> Builder:
    from qsync_opt.models import get_workload

    def build(full: bool) -> tuple[nn.Module, Any]:
        if not full:
            return small()
        wl = get_workload(name)
        return wl.build(), wl.make_inputs(1, torch.device("cpu"))
    return build


def _small_resnet() -> nn.Module:
    from qsync_opt.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)


def _tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_gpt2(full: bool) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config() if full else GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                               vocab_size=512)
    seq = 1024 if full else 32
    ids = _tokens(cfg.vocab_size, 1 if full else 4, seq)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def _hf_bert_qa(full: bool) -> tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForQuestionAnswering

    cfg = BertConfig() if full else BertConfig(num_hidden_layers=2, hidden_size=64,
                                               num_attention_heads=4, intermediate_size=128,
                                               vocab_size=512, max_position_embeddings=64)
    b, seq = (1, 384) if full else (4, 32)
    mask = torch.ones(b, seq, dtype=torch.int64)
    mask[:, seq - seq // 8:] = 0  # padding at the end: the mask really masks
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, seq // 2, (b,), generator=gen)
    return BertForQuestionAnswering(cfg), {
        "input_ids": _tokens(cfg.vocab_size, b, seq), "attention_mask": mask,
        "token_type_ids": (torch.arange(seq) >= seq // 4).long().expand(b, seq).clone(),
        "start_positions": start, "end_positions": start + 2}


def _hf_llama(full: bool) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    # "full" is a 4-layer, d=1024 Llama (the 7B's 32 layers at d=4096 would take 27 GB here).
    cfg = (LlamaConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
           if full else LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=512))
    seq = 512 if full else 32
    ids = _tokens(cfg.vocab_size, 1 if full else 4, seq)
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def _hf_vit(full: bool) -> tuple[nn.Module, Any]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = (ViTConfig(num_labels=1000) if full else
           ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64,
                     num_attention_heads=4, intermediate_size=128, num_labels=10))
    b = 1 if full else 4
    x = torch.randn(b, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, cfg.num_labels, (b,), generator=torch.Generator().manual_seed(1))
    return ViTForImageClassification(cfg), {"pixel_values": x, "labels": labels}


def _hf_distilbert(full: bool) -> tuple[nn.Module, Any]:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = (DistilBertConfig() if full else
           DistilBertConfig(n_layers=2, dim=64, n_heads=4, hidden_dim=128, vocab_size=512,
                            max_position_embeddings=64))
    b, seq = (1, 512) if full else (4, 32)
    return DistilBertForSequenceClassification(cfg), {
        "input_ids": _tokens(cfg.vocab_size, b, seq),
        "attention_mask": torch.ones(b, seq, dtype=torch.int64),
        "labels": torch.randint(0, 2, (b,), generator=torch.Generator().manual_seed(1))}


def _hf_t5(full: bool) -> tuple[nn.Module, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    # T5Config()'s defaults are t5-small's dimensions (6+6 layers, d=512).
    cfg = (T5Config(decoder_start_token_id=0, pad_token_id=0) if full else
           T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=512,
                    decoder_start_token_id=0, pad_token_id=0))
    b, seq = (1, 512) if full else (4, 32)
    ids = _tokens(cfg.vocab_size, b, seq)
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": _tokens(
        cfg.vocab_size, b, seq // 4, seed=1)}


FAMILIES: dict[str, tuple[str, Builder]] = {
    "resnet50": ("qsync-opt built-in (torchvision layout)",
                 _builtin("resnet50", lambda: (_small_resnet(), torch.randn(4, 3, 32, 32)))),
    "mobilenet_v3_like": ("torch-native: depthwise convs, in-place Hardswish, squeeze-excitation",
                       lambda full: patterns.mobilenet_v3_like(full=full)),
    "resnext_like": ("torch-native: grouped 3x3 convs (ResNeXt 32x4d block)",
                     lambda full: patterns.resnext_like(full=full)),
    "vit_mha": ("torch-native: ViT on nn.MultiheadAttention (torchvision's ViT)",
                lambda full: patterns.vit_mha(full=full)),
    "timm_vit": ("torch-native: timm-style attention, fused qkv + F.scaled_dot_product_attention",
                 lambda full: patterns.timm_vit(full=full)),
    "swin_like": ("torch-native: window attention, F.linear inside a helper function",
                    lambda full: patterns.swin_like(full=full)),
    "hf_gpt2": ("transformers GPT2LMHeadModel (Conv1D, SDPA)", _hf_gpt2),
    "hf_bert_qa": ("transformers BertForQuestionAnswering, attention mask", _hf_bert_qa),
    "hf_llama": ("transformers LlamaForCausalLM (RMSNorm, rotary, GQA, SDPA)", _hf_llama),
    "hf_vit": ("transformers ViTForImageClassification", _hf_vit),
    "hf_distilbert": ("transformers DistilBertForSequenceClassification", _hf_distilbert),
    "hf_t5": ("transformers T5ForConditionalGeneration (encoder-decoder, cross-attention)",
              _hf_t5),
}


# ----------------------------------------------------------------------------- one row


@dataclass
class Row:
    name: str
    what: str
    batch: int = 0
    ops: int = 0
    choosable: int = 0
    params_m: float = 0.0
    gflops: float = 0.0
    gemm_flops_pct: float = 0.0
    choosable_flops_pct: float = 0.0
    unseen: list[str] = field(default_factory=list)
    trace_method: str = ""
    trace_s: float = 0.0
    solve_s: float = 0.0
    solve_status: str = ""
    t4_fp32_ms: float = math.nan
    t4_mixed_ms: float = math.nan
    t4_mix: str = ""
    swapped_ok: bool | None = None
    swap_problem: str = ""
    loss_first: float = math.nan
    loss_last: float = math.nan
    trained: bool | None = None
    error: str = ""


def _solve(graph: qs.ModelGraph) -> tuple[qs.Plan, Any, float]:
    cluster = qs.load_cluster(CLUSTER)
    t0 = time.perf_counter()
    problem = AllocationProblem(graph, cluster, qs.estimate(graph, cluster),
                                random_indicator(graph), ProblemOptions())
    plan, report = solve(problem, solver="highs")
    return plan, report, time.perf_counter() - t0


def _mixed_t4_plan(graph: qs.ModelGraph) -> tuple[qs.Plan, float, float]:
    """A T4 plan that cycles every unit through its menu (fp32, bf16, fp16, int8, ... in
    turn): every precision the runtime has is applied and counted. (At these small sizes a
    T4's estimated step is bound by kernel launches, so a solved plan would stay all fp32.)
    Returns (plan, the T4's estimated fp32 ms, this plan's ms)."""
    cluster = qs.load_cluster("t4x1")
    problem = AllocationProblem(graph, cluster, qs.estimate(graph, cluster),
                                random_indicator(graph), ProblemOptions(lower_reference=True))
    assignment = {g.name: [(u + 1) % len(c) for u, c in enumerate(g.choices)]
                  for g in problem.groups}
    return (problem.make_plan(assignment), problem.makespan_ms(problem.reference_assignment()),
            problem.makespan_ms(assignment))


def _mix(plan: qs.Plan, group: str) -> str:
    counts: dict[str, int] = {}
    for p in plan.groups[group].precisions.values():
        counts[str(getattr(p, "value", p))] = counts.get(str(getattr(p, "value", p)), 0) + 1
    return " ".join(f"{n} {p}" for p, n in sorted(counts.items(), key=lambda x: -x[1]))


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(
        *(inputs if isinstance(inputs, tuple | list) else (inputs,)))


def run_family(name: str, what: str, build: Builder) -> Row:
    row = Row(name, what)
    try:
        torch.manual_seed(0)
        model, ex = build(True)
        t0 = time.perf_counter()
        g = qs.trace(model, example_inputs=ex)
        row.trace_s = time.perf_counter() - t0
        row.batch, row.ops, row.choosable = g.batch_size, len(g.ops), len(g.choosable_ops())
        row.params_m = g.param_count / 1e6
        total = g.total_fwd_flops
        row.gflops = total / 1e9
        row.gemm_flops_pct = 100 * sum(o.fwd_flops for o in g.ops if o.kind.value in
                                       ("linear", "conv", "matmul")) / max(total, 1)
        row.choosable_flops_pct = 100 * sum(o.fwd_flops for o in g.choosable_ops()) / max(total, 1)
        row.unseen = unseen_ops(g)
        row.trace_method = g.trace_method
        _, rep, row.solve_s = _solve(g)
        row.solve_status = str(rep.status)
        del model

        torch.manual_seed(0)
        model, ex = build(False)
        g = qs.trace(model, example_inputs=ex)
        plan, row.t4_fp32_ms, row.t4_mixed_ms = _mixed_t4_plan(g)
        row.t4_mix = _mix(plan, "t4")
        apply_plan(model, plan, "t4", graph=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            if step == 0:
                with count_calls(model) as calls:
                    out = _call(model, ex)
                    loss = default_loss(out, ex)
                    loss.backward()
                want = plan.groups["t4"].precisions
                bad = [f"{op}: planned {getattr(p, 'value', p)}, ran {sorted(calls.get(op, {}))}"
                       for op, p in want.items()
                       if set(calls.get(op, {})) != {str(getattr(p, "value", p))}]
                bad += [f"{op}: not planned, ran {sorted(seen)}" for op, seen in calls.items()
                        if op not in want and set(seen) - {"fp32"}]
                row.swapped_ok = not bad
                row.swap_problem = "; ".join(bad[:3])
            else:
                out = _call(model, ex)
                loss = default_loss(out, ex)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        row.loss_first, row.loss_last = losses[0], losses[-1]
        row.trained = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    except Exception as exc:  # a row that failed says how, and the table goes on
        row.error = f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="families to run (default: all)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    names = args.only or list(FAMILIES)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}, load {' '.join(load)}; cluster {CLUSTER}")
    header = ("family", "method", "params M", "batch", "ops", "choosable", "GEMM % FLOPs", "choosable % FLOPs",
              "unseen",
              "trace s", "solve s", "small: mixed t4 plan", "swaps", "loss 1st->3rd", "trained")
    print(" | ".join(header))
    rows = []
    for name in names:
        what, build = FAMILIES[name]
        r = run_family(name, what, build)
        rows.append(r)
        if r.error:
            print(f"{r.name} | ERROR {r.error}")
            continue
        print(" | ".join(str(c) for c in (
            r.name, r.trace_method, f"{r.params_m:.1f}", r.batch, r.ops, r.choosable,
            f"{r.gemm_flops_pct:.1f}", f"{r.choosable_flops_pct:.1f}", len(r.unseen), f"{r.trace_s:.2f}",
            f"{r.solve_s:.2f}",
            r.t4_mix, "ok" if r.swapped_ok else f"FAIL {r.swap_problem}",
            f"{r.loss_first:.3f}->{r.loss_last:.3f}", "yes" if r.trained else "NO")))
    if args.json:
        atomic_write_text(args.json, json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
