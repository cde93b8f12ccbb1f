"""The parsers of ``models``, ``devices`` and ``schema`` (their bodies:
:mod:`qsync_opt.cli.workloads` and :mod:`qsync_opt.cli.info`)."""

from __future__ import annotations

import argparse
from typing import Any

from qsync_opt.cli.args import Deferred, command
from qsync_opt.documents.schemas import schema_names


def add_models_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``models`` (its body: :func:`~qsync_opt.cli.workloads.cmd_models`)."""
    sp = command(sub, "models", "list the built-in workloads")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.workloads", "cmd_models"))
    return sp


def add_devices_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``devices`` (its body: :func:`~qsync_opt.cli.info.cmd_devices`)."""
    sp = command(sub, "devices", "list the device catalog")
    sp.add_argument("--cpu", action="store_true", help="also measure and show this machine's CPU")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.info", "cmd_devices"))
    return sp


def add_schema_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``schema`` (its body: :func:`~qsync_opt.cli.info.cmd_schema`)."""
    sp = sub.add_parser("schema", help="print the JSON Schema of a document")
    sp.add_argument("name", help=f"one of: {', '.join(schema_names())}")
    sp.set_defaults(fn=Deferred("qsync_opt.cli.info", "cmd_schema"), json=True)
    return sp
