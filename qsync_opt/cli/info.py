"""Commands that list what qsync-opt knows: ``models``, ``devices``, ``schema``."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import command, emit_json
from qsync_opt.cli.summaries import GiB, format_table
from qsync_opt.core.precision import DType
from qsync_opt.costs.devices import CATALOG, get_device
from qsync_opt.documents.schemas import json_schema, schema_names


def cmd_models(args: argparse.Namespace) -> int:
    from qsync_opt.models import WORKLOADS  # lazy: the registry imports torch

    rows = [(w.name, w.default_batch, w.input_doc, "real" if w.real_data else "synthetic",
             w.description) for w in WORKLOADS.values()]
    if args.json:
        emit_json([{"name": r[0], "default_batch": r[1], "inputs": r[2], "data": r[3],
                     "description": r[4]} for r in rows])
    else:
        print(format_table(rows, ["model", "batch", "inputs", "data", "description"]))
        print("\nYour own model: --model path/file.py:fn, where fn() returns (module, example_inputs) "
              "(a tensor, a tuple or a dict of keyword tensors); optional loss(outputs, batch) "
              "and data(batch_size, seed) in the same file. That file is run (imported), so "
              "pass only a file you trust.")
    return 0


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


# ----------------------------------------------------------------------------- parsers


def add_models_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``models`` to the CLI's subparsers (its default ``fn``: :func:`cmd_models`)."""
    sp = command(sub, "models", "list the built-in workloads")
    sp.set_defaults(fn=cmd_models)
    return sp


def add_devices_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``devices`` to the CLI's subparsers (its default ``fn``: :func:`cmd_devices`)."""
    sp = command(sub, "devices", "list the device catalog")
    sp.add_argument("--cpu", action="store_true", help="also measure and show this machine's CPU")
    sp.set_defaults(fn=cmd_devices)
    return sp


def add_schema_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``schema`` to the CLI's subparsers (its default ``fn``: :func:`cmd_schema`)."""
    sp = sub.add_parser("schema", help="print the JSON Schema of a document")
    sp.add_argument("name", help=f"one of: {', '.join(schema_names())}")
    sp.set_defaults(fn=cmd_schema, json=True)
    return sp
