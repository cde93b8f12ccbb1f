"""Names a package re-exports but imports only when first read.

A package whose modules import torch (or another heavy library) lists those names with their
modules; importing the package stays light, and the first read of a name imports its module
and keeps the value in the package's namespace, so later reads are plain lookups."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_getattr(package: str, namespace: MutableMapping[str, Any],
                 table: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``table`` maps a name to its module (a
    dotted name, or a bare one taken inside ``package``); the value read is stored into
    ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        full = module if "." in module else f"{package}.{module}"
        value = getattr(importlib.import_module(full), name)
        namespace[name] = value
        return value

    return __getattr__
