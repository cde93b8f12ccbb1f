"""The ``models`` command: the built-in workloads listed (the registry imports torch); its
parser is :mod:`qsync_opt.cli.parsers.info`."""

from __future__ import annotations

import argparse

from qsync_opt.cli.args import emit_json
from qsync_opt.cli.summaries import format_table
from qsync_opt.models import WORKLOADS


def cmd_models(args: argparse.Namespace) -> int:
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
