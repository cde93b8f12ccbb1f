"""This rank's end of the emulated link (``train --emulate-link``): every message the rank
hands the network takes, on top of the real gloo transfer, the time the link's figures give
it (:class:`qsync_opt.costs.link.LinkSpec`: bytes over bandwidth plus latency, the ring
all-reduce's ``2(n-1)/n`` and ``2(n-1)`` hops).

A link carries one message at a time: each message is done at
``max(ready, the link's previous message done) + delay``, with ``ready`` the moment the real
transfer completed (or, for a point-to-point message, the moment it was sent). Deadlines,
not sleeps, are what add up, so a sleep that overshoots never delays the next message.
Clocks are ``time.monotonic`` (one clock for every process of a machine: the link is for
ranks on one machine).

* A blocking collective (the statistics all-reduce, the buffer broadcast, Local SGD's
  averaging) waits after its call: :meth:`LinkClock.block`.
* DDP's bucket all-reduce is asynchronous and overlaps backward: :meth:`LinkClock.after`
  hands its future to this rank's link thread, which completes a new future once the real
  one is done and the link has carried the bucket; the backward thread never waits for it
  (DDP waits for its buckets' futures at the end of backward, as for a real slow link).
* A pipeline's payload waits on the receiving side (:meth:`LinkClock.arrive`), from the
  moment the sender sent it, so a receiver busy computing while the payload travels does not
  wait again.

:meth:`LinkClock.take_ms` gives the emulated delay charged since its last call: the
metrics row's ``link_ms``, a deterministic figure (the formula over the real bytes).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from qsync_opt.costs.link import LinkSpec

__all__ = ["LinkClock", "link_fields", "sleep_until"]

#: The key of the collectives' link in :attr:`LinkClock._busy` (a pair of ranks keys a send).
_RING = "ring"


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline`` (at once when it has)."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


class LinkClock:
    """The emulated link as rank ``rank`` sees it (module docstring)."""

    def __init__(self, spec: LinkSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self._busy: dict[Hashable, float] = {}
        self._lock = threading.Lock()
        self._charged_s = 0.0
        self._queue: queue.Queue[Any] | None = None

    def _deadline(self, key: Hashable, ready: float, delay: float) -> float:
        """When a message ready at ``ready`` is through link ``key`` (and the link is busy
        until then); the delay is charged."""
        with self._lock:
            end = max(ready, self._busy.get(key, float("-inf"))) + delay
            self._busy[key] = end
            self._charged_s += delay
        return end

    def describe(self) -> str:
        return self.spec.describe()

    def take_ms(self) -> float:
        """The emulated delay charged since the last call, ms (3 decimals), and reset."""
        with self._lock:
            s, self._charged_s = self._charged_s, 0.0
        return round(s * 1000, 3)

    # -- blocking collectives
    def block(self, kind: str, nbytes: int, ranks: Sequence[int] | None = None) -> float:
        """After a blocking collective of ``nbytes`` over ``ranks`` (default all): wait until
        the link has carried it. Returns the delay, seconds."""
        delay = self.spec.delay_s(kind, nbytes, ranks)
        sleep_until(self._deadline(_RING, time.monotonic(), delay))
        return delay

    # -- asynchronous collectives
    def after(self, fut: torch.futures.Future[Any], kind: str, nbytes: int,
              ranks: Sequence[int] | None = None) -> torch.futures.Future[Any]:
        """A future completed with ``fut``'s value once ``fut`` is done and the link has
        carried the message (on this rank's link thread; the caller does not wait)."""
        delay = self.spec.delay_s(kind, nbytes, ranks)
        done_at: list[float] = []
        fut.add_done_callback(lambda _: done_at.append(time.monotonic()))
        out: torch.futures.Future[Any] = torch.futures.Future()
        self._worker().put((fut, done_at, delay, out))
        return out

    def _worker(self) -> queue.Queue[Any]:
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._carry, args=(self._queue,), daemon=True,
                             name=f"qsync-link-rank{self.rank}").start()
        return self._queue

    def _carry(self, q: queue.Queue[Any]) -> None:
        """The link thread: the messages in the order they were handed over, one at a time."""
        while True:
            fut, done_at, delay, out = q.get()
            try:
                fut.wait()
            except Exception as exc:  # the real collective failed: so does its delayed one
                out.set_exception(exc)
                continue
            ready = done_at[0] if done_at else time.monotonic()
            sleep_until(self._deadline(_RING, ready, delay))
            out.set_result(fut.value())

    # -- point to point
    def sent_stamp(self) -> int:
        """The send time a sender writes into a payload's header (ns of ``time.monotonic``)."""
        return time.monotonic_ns()

    def arrive(self, src: int, sent_ns: int, nbytes: int) -> float:
        """A payload of ``nbytes`` from rank ``src``, sent at ``sent_ns``, received: wait until
        the link from ``src`` has carried it. Returns the delay, seconds."""
        delay = self.spec.delay_s("send", nbytes, [src, self.rank])
        now = time.monotonic()
        ready = min(sent_ns * 1e-9, now)  # a clock from elsewhere never stalls the run
        sleep_until(self._deadline((src, self.rank), ready, delay))
        return delay


def link_fields(link: LinkClock | None) -> dict[str, Any]:
    """A metrics row's link fields: ``link`` (its description) and ``link_ms`` (the emulated
    delay this rank was charged during the step); nothing without a link."""
    if link is None:
        return {}
    return {"link": link.describe(), "link_ms": link.take_ms()}
