"""The emulated link's clock (:class:`qsync_opt.runtime.link.LinkClock`) on a fake clock, so
every figure is exact: a blocking collective waits its delay, messages queue one at a time,
an asynchronous one completes on the link's thread without holding its caller, a failed one
fails its delayed future, and a pipeline payload waits from its send time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from qsync_opt.costs.cluster import load_cluster
from qsync_opt.costs.link import LinkSpec, resolve_link
from qsync_opt.runtime import link as link_module
from qsync_opt.runtime.link import LinkClock, link_fields


class FakeClock:
    """``time`` as the link reads it: ``sleep`` moves the clock, nothing waits."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.slept: list[float] = []
        self.lock = threading.Lock()

    def monotonic(self) -> float:
        with self.lock:
            return self.now

    def monotonic_ns(self) -> int:
        return int(round(self.monotonic() * 1e9))

    def sleep(self, s: float) -> None:
        with self.lock:
            self.now, self.slept = self.now + s, [*self.slept, s]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The link's ``time`` module, faked for the test."""
    monkeypatch.setattr(link_module, "time", FakeClock())
    return link_module.time  # type: ignore[return-value]  # the fake


def _spec() -> LinkSpec:
    # two groups, one rank each: every pair crosses the 0.01 GB/s, 1000 us link
    return resolve_link("bw=0.01,latency_us=1000", load_cluster("cpux1+cpu/2x1"),
                        ["cpu", "cpu_2"])


def test_a_blocking_collective_waits_its_delay_and_the_next_queues(clock: FakeClock) -> None:
    link = LinkClock(_spec(), 0)
    d = link.block("allreduce", 10**6)      # 1e6 / 1e7 s + 2 hops of 1 ms = 0.102 s
    assert d == pytest.approx(0.102)
    assert clock.now == pytest.approx(100.102)
    link.block("broadcast", 0)               # one hop: 1 ms
    assert clock.now == pytest.approx(100.103)
    assert link.take_ms() == 103.0 and link.take_ms() == 0.0
    assert link_fields(link) == {"link": "emulated 0.01 GB/s, 1000 us", "link_ms": 0.0}
    assert link_fields(None) == {}


def test_an_asynchronous_collective_completes_on_the_link_thread(clock: FakeClock) -> None:
    link = LinkClock(_spec(), 0)
    real: torch.futures.Future[Any] = torch.futures.Future()
    out = link.after(real, "allreduce", 10**5)   # 0.01 s + 2 ms
    # the caller got its future back while the real collective is still in flight
    assert not out.done()
    seen: list[str] = []
    called = threading.Event()

    def note(_: object) -> None:
        seen.append(threading.current_thread().name)
        called.set()

    out.add_done_callback(note)
    real.set_result(torch.ones(3))
    assert torch.equal(out.wait(), torch.ones(3))
    assert clock.now == pytest.approx(100.012)
    # wait() returns once the result is set; the thread that set it may still be running
    # the callbacks (seen under a loaded parallel run): wait for ours, then check the thread
    assert called.wait(60)
    assert seen == ["qsync-link-rank0"]
    assert link.take_ms() == 12.0


def test_messages_on_the_link_go_one_at_a_time(clock: FakeClock) -> None:
    link = LinkClock(_spec(), 0)
    futs = []
    for _ in range(3):  # three buckets ready at once
        real: torch.futures.Future[Any] = torch.futures.Future()
        real.set_result(torch.zeros(1))
        futs.append(link.after(real, "allreduce", 10**5))
    for f in futs:
        f.wait()
    assert clock.now == pytest.approx(100.036)  # 3 x 12 ms, back to back
    link.block("allreduce", 10**5)  # a blocking one after them starts when they are done
    assert clock.now == pytest.approx(100.048)


def test_a_failed_collective_fails_its_delayed_future(clock: FakeClock) -> None:
    link = LinkClock(_spec(), 0)
    real: torch.futures.Future[Any] = torch.futures.Future()
    out = link.after(real, "allreduce", 10)
    real.set_exception(RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        out.wait()
    ok: torch.futures.Future[Any] = torch.futures.Future()  # the link thread goes on
    ok.set_result(1)
    assert link.after(ok, "allreduce", 0).wait() == 1


def test_a_payload_waits_from_its_send_time(clock: FakeClock) -> None:
    link = LinkClock(_spec(), 1)
    # sent long ago (the receiver was busy meanwhile): the idle link carried it already
    link.arrive(0, clock.monotonic_ns() - 10**10, 10**5)
    assert clock.now == 100.0
    sent = link.sent_stamp()
    d = link.arrive(0, sent, 10**5)              # 0.01 s + 1 ms
    assert d == pytest.approx(0.011) and clock.now == pytest.approx(100.011)
    # two sent at once on one link: the second behind the first
    sent = link.sent_stamp()
    link.arrive(0, sent, 10**5)
    link.arrive(0, sent, 10**5)
    assert clock.now == pytest.approx(100.033)
    # a stamp from a clock ahead of ours never stalls the run beyond the delay
    link.arrive(0, clock.monotonic_ns() + 10**15, 0)
    assert clock.now == pytest.approx(100.034)
    assert link.take_ms() == pytest.approx(45.0)


def test_the_real_clock_waits_at_least_the_delay() -> None:
    link = LinkClock(_spec(), 0)
    t0 = time.monotonic()
    link.block("send", 10**5, [0, 1])  # 11 ms
    assert time.monotonic() - t0 >= 0.011
