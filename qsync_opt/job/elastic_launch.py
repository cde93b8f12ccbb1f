"""``qsync-opt train --elastic``'s launch: one torchrun elastic agent per device group.

Every agent joins one c10d rendezvous (``--rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id RUN --nnodes 1:G``, G the run's groups) and runs its group's ranks
(``QSYNC_NODE_GROUP``); when a node leaves or joins, torchrun restarts the ranks of every
agent and the ranks re-plan and resume (:mod:`qsync_opt.job.elastic`). The rendezvous's
store is hosted apart from every agent (``is_host=false``): on this machine by the
launcher, on a cluster by a machine that stays (:func:`cluster_commands`), so any group may
leave, the first one included. The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
each world gets a fresh store from its rank 0, nothing of the last world left in it.

On this machine (:func:`run_local`) the launcher starts the agents, copies their output
(each line prefixed with its group), and plays the membership schedule (``--membership``):

* ``GROUP-@N`` (graceful): ``OUT/leave/GROUP`` holding ``N`` is written ahead; at step N
  every rank checkpoints, the group's ranks stop their agent, the others restart;
* ``GROUP-@N:crash``: the group's agent gets ``QSYNC_ELASTIC_CRASH_AT=N``; at step N one
  of its ranks kills it with SIGKILL (a node losing power) and dies; the others' collectives
  fail and they restart from the last checkpoint;
* ``GROUP+@M``: once the run has committed a checkpoint at step M or later (the ranks end
  their world there for the return), or at once when no group is left, a new agent for
  the group starts and joins.

When every group is gone the launcher waits :attr:`ElasticSpec.all_gone_s` seconds for a
world to start again (an agent of another machine may join the rendezvous), then writes
the ``stop`` event, the checkpoint untouched, and returns 1.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.documents.outfolder import write_text
from qsync_opt.runtime.events import read_events
from qsync_opt.runtime.membership import (
    CRASH_AT_ENV,
    LEAVE_DIR,
    NODE_DEVICE_ENV,
    NODE_GROUP_ENV,
    Change,
    ElasticSpec,
    parse_endpoint,
    write_stop,
)

__all__ = ["AGENT_MODULE", "LAST_CALL_S", "Agents", "agent_command", "cluster_commands",
           "run_local"]

#: The ranks' entry under the agents (it wires the re-plan in: it sits above the planner).
AGENT_MODULE = "qsync_opt.cli.elastic"
#: Seconds the rendezvous waits for more nodes once one is there: a returning agent must
#: join within it to be part of the same world; each leave costs it once. On this machine a
#: returning agent is started ahead and held (:data:`_HELD_AGENT`), so it joins within a
#: fraction of a second of its go.
LAST_CALL_S = 2
#: An agent started ahead and held: torch imported, it waits for a line on stdin (the
#: launcher's go), then runs torchrun with its arguments.
_HELD_AGENT = """\
import sys
import torch.distributed.run as run
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
sys.argv = ["torchrun", *sys.argv[1:]]
run.main()
"""
#: Seconds between the launcher's looks at the agents and the event log.
POLL_S = 0.2


def _rdzv_conf(last_call_s: int) -> str:
    # is_host=false: the store lives apart from every agent; heartbeats every second, a
    # node dead after three missed, so a crashed node's place frees in seconds
    return (f"is_host=false,last_call_timeout={last_call_s},join_timeout=600,"
            "keep_alive_interval=1,keep_alive_max_attempt=3")


def agent_command(config_path: str | Path, nproc: int, endpoint: str, run_id: str,
                  groups: int, max_restarts: int, last_call_s: int = LAST_CALL_S,
                  python: str | None = None) -> list[str]:
    """One node's torchrun elastic agent for ``nproc`` ranks of its group."""
    return [python or sys.executable, "-m", "torch.distributed.run",
            "--nnodes", f"1:{groups}", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", _rdzv_conf(last_call_s), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", "-m", AGENT_MODULE, str(config_path)]


def cluster_commands(spec: ElasticSpec, config_path: Path, run_id: str,
                     max_restarts: int, endpoint: str = "HOST0:29400") -> list[str]:
    """The per-machine commands of an elastic run on a cluster: the store on a machine that
    stays, then one agent per group on its machine (config and out dir on a shared
    filesystem, or copied to the same path)."""
    host = endpoint.rpartition(":")[0]
    lines = [f"# elastic run {run_id}: {len(spec.groups)} group(s), one agent per machine; "
             "the config and --out at the same path on every machine (shared filesystem)",
             f"# the rendezvous store, on a machine that stays ({host}: e.g. the head node):",
             f"python -m {__name__} --store {shlex.quote(endpoint)}"]
    for g in spec.groups:
        cmd = agent_command(config_path, spec.ranks[g], endpoint, run_id, len(spec.groups),
                            max_restarts, last_call_s=30, python="python")
        lines.append(f"# group {g} ({spec.ranks[g]} rank(s), {spec.devices[g]}):")
        lines.append(f"OMP_NUM_THREADS=1 {NODE_GROUP_ENV}={shlex.quote(g)} "
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                     + " ".join(shlex.quote(c) for c in cmd))
    return lines


@dataclass
class Agents:
    """The agents this launcher runs, by group, and what became of them."""

    spec: ElasticSpec
    config_path: Path
    endpoint: str
    run_id: str
    max_restarts: int
    env: dict[str, str]
    last_call_s: int = LAST_CALL_S
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    held: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    exits: list[tuple[str, int]] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def hold(self, group: str, crash_at: int | None, device: str | None = None) -> None:
        """Start ``group``'s agent ahead, held before torchrun runs (:data:`_HELD_AGENT`);
        ``device``: the one its node has now (None: the one its group left with)."""
        env = dict(self.env, **{NODE_GROUP_ENV: group,
                                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        env.pop(CRASH_AT_ENV, None)
        env.pop(NODE_DEVICE_ENV, None)
        if device is not None:
            env[NODE_DEVICE_ENV] = device
        if crash_at is not None:
            env[CRASH_AT_ENV] = str(crash_at)
        cmd = agent_command(self.config_path, self.spec.ranks[group], self.endpoint,
                            self.run_id, len(self.spec.groups), self.max_restarts,
                            self.last_call_s)
        cmd[1:3] = ["-c", _HELD_AGENT]  # python -c HELD ARGS... instead of -m torch...run
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, text=True, bufsize=1,
                                start_new_session=True)
        self.held[group] = proc
        t = threading.Thread(target=_copy, args=(proc.stdout, f"[{group}] "), daemon=True)
        t.start()
        self.threads.append(t)

    def start(self, group: str) -> None:
        """Let ``group``'s agent go (held ahead: :meth:`hold`)."""
        proc = self.held.pop(group)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
        self.procs[group] = proc

    def reap(self) -> list[str]:
        """The groups whose agent exited since the last call."""
        gone = [g for g, p in self.procs.items() if p.poll() is not None]
        for g in gone:
            self.exits.append((g, self.procs.pop(g).returncode))
        return gone

    def stop_all(self, sig: int) -> None:
        for p in [*self.procs.values(), *self.held.values()]:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _copy(stream: IO[str] | None, prefix: str) -> None:
    """An agent's output, each line prefixed; the traceback torchrun prints when its agent
    is stopped by a signal (the way a group leaves) becomes one line."""
    if stream is None:
        return
    block: list[str] = []
    for line in stream:
        if block or line.startswith("Traceback (most recent call last)"):
            block.append(line)
            if len(block) == 1 or line[:1] in (" ", "\t"):
                continue
            if "SignalException" in line:
                line = "torchrun agent stopped by a signal (its group left)\n"
            else:
                sys.stdout.write("".join(prefix + b for b in block[:-1]))
            block = []
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def host_store(endpoint: str) -> Any:
    """The rendezvous's store, hosted by this process (kept alive by the caller). Its server
    listens on the port on every interface; this process's own client reaches it over the
    loopback, so the endpoint's host is only what the other machines dial (a name that
    does not lead back here would otherwise make the host wait out its timeout)."""
    port = int(endpoint.rpartition(":")[2])
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=600))


def _next_changes(changes: Sequence[Change]) -> dict[str, list[Change]]:
    by: dict[str, list[Change]] = {}
    for c in changes:
        by.setdefault(c.group, []).append(c)
    return by


def _next_leave(pending: list[Change]) -> Change | None:
    return pending[0] if pending and pending[0].leave else None


def _arm(agents: Agents, out: Path, group: str, pending: list[Change]) -> None:
    """Let ``group``'s agent go with its next leave armed: a crash's step in its
    environment (given when it was held), a graceful leave's step in ``OUT/leave/GROUP``."""
    nxt = _next_leave(pending)
    if nxt is not None and nxt.mode == "graceful":
        write_text(out, Path(LEAVE_DIR, group), f"{nxt.step}\n")
    if group not in agents.held:
        agents.hold(group, nxt.step if nxt is not None and nxt.mode == "crash" else None)
    agents.start(group)


def _hold_return(agents: Agents, group: str, pending: list[Change]) -> None:
    """After ``group`` left: its returning agent started ahead and held, its crash (the
    leave after the return, if one) armed."""
    if pending and not pending[0].leave and group not in agents.held:
        after = _next_leave(pending[1:])
        agents.hold(group, after.step if after is not None and after.mode == "crash" else None,
                    pending[0].device)


def run_local(agents: Agents, out: Path, changes: Sequence[Change]) -> tuple[int, str]:
    """Run the agents on this machine, play ``changes``; (exit code, the stop's reason)."""
    todo = _next_changes(changes)
    base = len(read_events(out))  # a resumed run's folder holds the earlier runs' events
    for g in agents.spec.groups:
        _arm(agents, out, g, todo.get(g, []))
    gone_since: float | None = None
    seen = base
    failed: list[tuple[str, int]] = []  # agents that ended unplanned, with an error
    while True:
        time.sleep(POLL_S)
        for g in agents.reap():
            pend = todo.get(g, [])
            if pend and pend[0].leave:
                pend.pop(0)  # the leave happened
            elif agents.exits[-1][1] != 0:
                failed.append(agents.exits[-1])
            _hold_return(agents, g, pend)
        events = read_events(out)
        stop = next((e for e in events[max(base, seen):] if e["kind"] == "stop"), None)
        if stop is not None and not agents.procs:
            return (0 if stop.get("reason") == "done" else 1), str(stop.get("reason"))
        reached = max((e["step"] for e in events[base:] if e["kind"] == "checkpoint"),
                      default=0)
        for g, pend in todo.items():
            if (g not in agents.procs and pend and not pend[0].leave
                    and (reached >= pend[0].step or not agents.procs)):
                pend.pop(0)
                _arm(agents, out, g, pend)
        if agents.procs or stop is not None:
            gone_since = None
            continue
        if failed and not any(p and not p[0].leave for p in todo.values()):
            return 1, _stopped(out, "the agents failed (exit codes: " + ", ".join(
                f"{g} {rc}" for g, rc in failed[-8:]) + "; their output above says why)")
        if gone_since is None:
            gone_since, seen = time.monotonic(), len(events)
        elif any(e["kind"] == "world" for e in events[seen:]):
            gone_since = None
        elif time.monotonic() - gone_since >= agents.spec.all_gone_s:
            return 1, _all_gone(out, agents.spec.all_gone_s, agents.exits)


def _all_gone(out: Path, waited: float, exits: list[tuple[str, int]]) -> str:
    """Every group is gone and none came back: the ``stop`` event (this launcher writes it:
    no world runs), the checkpoint left as it is."""
    codes = ", ".join(f"{g} {rc}" for g, rc in exits[-8:])
    return _stopped(out, f"every group is gone (agents' exit codes: {codes}); waited "
                         f"{waited:g} s for one to return (--all-gone-timeout)")


def _stopped(out: Path, reason: str) -> str:
    """The ``stop`` event, written by this launcher (no world runs), the checkpoint left as
    it is; the reason with the checkpoint named."""
    cs = write_stop(out, reason)
    return reason + (f"; the checkpoint {cs.path} (step {cs.step}) is intact" if cs else "")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qsync_opt.job.elastic_launch --store HOST:PORT``: host an elastic run's
    rendezvous store on a machine that stays, until killed."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--store":
        sys.stderr.write(f"usage: python -m {__name__} --store HOST:PORT\n")
        return 2
    try:
        store = host_store(parse_endpoint(args[1]))
    except QsyncInputError as exc:
        sys.stderr.write(f"qsync-opt: error: {exc}\n")
        return 2
    except (RuntimeError, OSError, ValueError) as exc:  # the address taken or not this host's
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        sys.stderr.write(f"qsync-opt: elastic: cannot host the rendezvous store at "
                         f"{args[1]}: {first}\n")
        return 1
    sys.stdout.write(f"rendezvous store at {args[1]}; stop it with Ctrl-C once the run is "
                     "over\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        del store
        return 0


if __name__ == "__main__":
    sys.exit(main())
