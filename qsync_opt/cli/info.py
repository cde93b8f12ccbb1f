"""Commands that list what qsync-opt knows: ``devices`` and ``schema`` (``models``, whose
registry imports torch, is :mod:`qsync_opt.cli.workloads`); their parsers are
:mod:`qsync_opt.cli.parsers.info`."""

from __future__ import annotations

import argparse

from qsync_opt.cli.args import emit_json
from qsync_opt.cli.summaries import GiB, format_table
from qsync_opt.core.precision import DType
from qsync_opt.costs.devices import CATALOG, get_device
from qsync_opt.documents.schemas import json_schema


def cmd_devices(args: argparse.Namespace) -> int:
    specs = [*CATALOG.values()]
    if args.cpu:
        specs.append(get_device("cpu"))
    if args.json:
        emit_json([s.model_dump(mode="json") for s in specs])
        return 0
    rows = []
    for s in specs:
        r = s.peak_tflops
        rows.append((s.name, s.compute_capability or "-", f"{s.usable_memory_bytes / GiB:.1f}",
                     s.memory_bandwidth_gb_per_s,
                     *(r.get(DType(k), "-") for k in ("fp32", "tf32", "fp16", "bf16", "int8",
                                                   "fp8_e4m3", "int4")),
                     ",".join(p.value for p in s.precisions)))
    print(format_table(rows, ["device", "cc", "GiB", "GB/s", "fp32", "tf32", "fp16", "bf16", "int8",
                        "fp8", "int4", "precisions"]))
    print("\nDense peak TFLOPS (TOPS for int8/int4) from datasheets; sources in qsync_opt/costs/devices.py.")
    rated = [f"{s.name} {DType(k).value} {v:.1f}" for s in specs for k, v in s.runtime_tflops.items()]
    if rated:
        print("The estimate uses the runtime's recorded rate instead of peak x efficiency for: "
              + ", ".join(rated) + " (torch._int_mm measured on an H200, the H100s derived; "
              "docs/DEVICES.md R1).")
    print("Emulated, but costed at the peaks above: fp8 = e4m3-rounded inputs and weights, FP32 "
          "GEMM, FP32 gradients;\nint8/int8_full attention matmuls = int8-rounded operands, FP32 "
          "matmul (int8_full: int8-rounded output gradients too). int8 Linear/Conv2d run real int8 GEMMs.")
    print("int4 is opt-in (on no default menu): DEVICE:int4 (t4:int4, cpu/2~t4:int4) or --int4 "
          "adds it where a card has an INT4 peak.\nHere int4 values [-7, 7] live in int8 storage "
          "and run through the exact int8 GEMM: int4's rounding, no int4 speed gain on this CPU.")
    if not args.cpu:
        print("`cpu` (this machine) is measured on first use: add --cpu to show it.")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    emit_json(json_schema(args.name))
    return 0
