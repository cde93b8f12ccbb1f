"""Plain values (dicts, lists, strings, numbers, None) gathered from every rank as JSON.

``torch.distributed.all_gather_object`` pickles what it sends and unpickles what it gets;
nothing the package reads is unpickled, so a rank's values travel here as the UTF-8 bytes of
their JSON in a uint8 tensor (every rank's length gathered first, each padded to the
longest). What comes back is what ``json.loads`` gives: a tuple sent arrives as a list, and
NaN and infinities arrive as themselves. CPU tensors: the process group must be able to
gather them (gloo, as the pipeline's is).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json"]


def all_gather_json(value: object) -> list[Any]:
    """``value`` of every rank of the default group, in rank order (every rank calls it)."""
    payload = json.dumps(value).encode("utf-8")
    world = dist.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    got = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(got, mine)
    return [json.loads(t[:int(n)].numpy().tobytes().decode("utf-8"))
            for t, n in zip(got, sizes, strict=True)]
