"""The pipeline across processes: one gloo rank per stage, payloads sent point to point.

Every rank builds the same :class:`~qsync_opt.pipeline.stages.Pipeline` (same seed, same
split, so the same initial weights) and runs only its own stage and its halves of the
boundaries that touch it: the sender's codec where it produces a crossing tensor, the
receiver's where it consumes one, so feedback state lives where it would on two machines.
torch's pipelining package cannot carry a custom payload or count its bytes, so the wire
protocol is ours: per payload one int64 header (its tensors' dtypes and shapes, the
payload's form), then each tensor; ``isend`` for every send (a skip tensor from stage 0 to
stage 2 cannot deadlock against the chain), all waited at the end of the step. The bytes
counted are the payload's tensors (``Payload.nbytes``, what ``Compressor.wire_bytes``
predicts); the header is framing and is counted apart (``header_bytes``).

With an emulated link (:class:`~qsync_opt.runtime.link.LinkClock`) the header also carries
its send time, and the receiver waits until the link from the sender has carried the
payload's bytes (``Payload.nbytes``, the compressed bytes) since then: ``bytes / bandwidth +
latency`` of the pair's link, one message at a time; the tie all-reduce takes its ring time.

The schedule is :meth:`Pipeline.train_step`'s: forwards of every micro-batch, then
backwards in reverse micro-batch order, each micro-batch's loss weighted by its share; a
tied parameter's gradient is all-reduced between the ranks that hold it (a group of those
ranks); each rank steps its own optimizer over its own stage.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.pipeline.stages import Pipeline
from qsync_opt.runtime.link import LinkClock
from qsync_opt.strategy.codecs import Payload

__all__ = ["BACKWARD_TAG", "DistStage", "recv_payload", "send_payload"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
_FORMS = ["", "indices", "bitmap"]
BACKWARD_TAG = 1 << 16  # gradients travel under their boundary's tag plus this


def _lookup(env: dict[str, Any], a: fx.Node) -> Any:
    return env[a.name]


def _header(p: Payload) -> Tensor:
    h = [len(p.tensors), _FORMS.index(p.form), _DTYPES.index(p.dtype), len(p.shape), *p.shape]
    for t in p.tensors:
        h += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(h, dtype=torch.int64)


def send_payload(p: Payload, dst: int, handles: list[Any], keep: list[Tensor],
                 tag: int = 0, link: LinkClock | None = None) -> int:
    """Send ``p`` to rank ``dst`` (non-blocking; ``handles``/``keep`` hold the requests and
    the tensors until they are waited); returns the header's bytes. With ``link`` the header
    ends with the send time (the receiver's :meth:`LinkClock.arrive`)."""
    h = _header(p)
    if link is not None:
        h = torch.cat([h, torch.tensor([link.sent_stamp()], dtype=torch.int64)])
    n = torch.tensor([h.numel()], dtype=torch.int64)
    for t in (n, h, *[t.detach().contiguous() for t in p.tensors]):
        keep.append(t)
        handles.append(dist.isend(t, dst, tag=tag))
    return (1 + h.numel()) * 8


def recv_payload(src: int, tag: int = 0, link: LinkClock | None = None
                 ) -> tuple[Payload, int]:
    """Receive one payload from rank ``src`` (blocking; with ``link``, until the emulated
    link has carried its bytes); returns it and its header's bytes."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, tag=tag)
    h = torch.zeros(int(n), dtype=torch.int64)
    dist.recv(h, src, tag=tag)
    v = h.tolist()
    count, form, dtype, ndim = v[0], _FORMS[v[1]], _DTYPES[v[2]], v[3]
    shape = tuple(v[4:4 + ndim])
    pos = 4 + ndim
    tensors = []
    for _ in range(count):
        dt, nd = _DTYPES[v[pos]], v[pos + 1]
        tshape = tuple(v[pos + 2:pos + 2 + nd])
        pos += 2 + nd
        t = torch.empty(tshape, dtype=dt)
        dist.recv(t, src, tag=tag)
        tensors.append(t)
    p = Payload(tuple(tensors), shape, dtype, form)
    if link is not None:
        link.arrive(src, v[-1], p.nbytes)
    return p, (1 + len(v)) * 8


class DistStage:
    """Rank ``rank``'s part of ``pipe`` (one stage per rank; world size = stages); ``link``:
    the emulated link its payloads and tie all-reduces cross (None: the real one alone)."""

    def __init__(self, pipe: Pipeline, rank: int, link: LinkClock | None = None) -> None:
        if dist.get_world_size() != len(pipe.stages):
            raise QsyncInputError(f"pipeline: {len(pipe.stages)} stages need as many ranks, "
                                  f"got {dist.get_world_size()}")
        self.pipe, self.rank, self.link = pipe, rank, link
        self.stage = pipe.stages[rank]
        self.header_bytes = 0
        # every rank creates every tie's group, in the same order (new_group is collective)
        self.tie_groups = []
        for tie in pipe.ties:
            ranks = sorted({k for k, _ in tie})
            self.tie_groups.append((tie, dist.new_group(ranks=ranks)))
        self.top = list(pipe.plan_nodes)
        self.tags = {name: i for i, name in enumerate(pipe.boundaries)}

    def _recv_act(self, name: str, src: int, idx: Tensor | None, slot: int,
                  mode: str) -> Tensor:
        """A crossing activation: decoded by the receiver's codec (``train``), by the
        compressor alone (``eval-compressed``), or as sent (``eval``)."""
        b = self.pipe.boundaries[name]
        p, hb = recv_payload(src, self.tags[name], self.link)
        self.header_bytes += hb
        if mode == "train":
            x = b.act_recv.decode(p, idx, slot)
            x = x.clone() if x.requires_grad else x
            x.requires_grad_(x.is_floating_point())
            return x
        return b.act_comp.decompress(p) if mode == "eval-compressed" else p.tensors[0]

    def _send_act(self, name: str, v: Any, idx: Tensor | None, slot: int, mode: str,
                  handles: list[Any], keep: list[Tensor]) -> None:
        bd = self.pipe.boundaries[name]
        if not isinstance(v, Tensor) or not v.is_floating_point():
            raise QsyncInputError(f"pipeline: {name.rsplit('->', 1)[0]!r} crosses stages "
                                  "and is not a floating tensor")
        if mode == "train":
            bd.last_shape = tuple(v.shape)
            p = bd.act_send.encode(v, idx, slot)
            bd.act_bytes += p.nbytes
            bd.act_raw += v.numel() * v.element_size()
        elif mode == "eval-compressed":
            p = bd.act_comp.compress(v)
        else:
            p = Payload((v.detach(),), tuple(v.shape), v.dtype)
        self.header_bytes += send_payload(p, bd.dst, handles, keep, self.tags[name],
                                          self.link)

    def _forward(self, inputs: Sequence[Tensor], targets: Tensor, share: float,
                 idx: Tensor | None, slot: int, loss_of: Callable[..., Tensor], mode: str,
                 handles: list[Any], keep: list[Tensor]
                 ) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]],
                            Tensor | None, Any]:
        """One micro-batch's forward on this rank: (received activations, sent ones, the
        weighted loss and the model's output on the last rank)."""
        last = len(self.pipe.stages) - 1
        env: dict[str, Any] = {}
        it = iter(inputs)
        recvd: list[tuple[str, Tensor]] = []
        sent: list[tuple[str, Tensor]] = []
        loss = out = None
        for n in self.top:
            if n.op == "placeholder":
                env[n.name] = next(it)
            elif n.op == "get_attr":
                env[n.name] = self.pipe.consts[n.name]
            elif n.op == "call_module":
                k = int(str(n.target).removeprefix("submod_"))
                if k != self.rank:
                    continue
                args = []
                for a in n.args:
                    if not isinstance(a, fx.Node):
                        args.append(a)
                        continue
                    src = self.pipe.producer(a)
                    if src is not None and src != self.rank:
                        name = f"{a.name}->{self.rank}"
                        x = self._recv_act(name, src, idx, slot, mode)
                        recvd.append((name, x))
                        args.append(x)
                    else:
                        args.append(env[a.name])
                env[n.name] = self.stage(*args)
            elif n.op == "call_function" and n.target is operator.getitem:
                src_node = n.args[0]
                if isinstance(src_node, fx.Node) and src_node.name in env:
                    env[n.name] = env[src_node.name][n.args[1]]
            elif n.op == "output" and self.rank == last:
                out = fx.node.map_arg(n.args[0], functools.partial(_lookup, env))
                loss = loss_of(out, list(inputs), targets) * share
            # after each node: send what this rank produced that another stage needs
            for name, bd in self.pipe.boundaries.items():
                value_name = name.rsplit("->", 1)[0]
                if bd.src == self.rank and value_name == n.name and value_name in env:
                    self._send_act(name, env[value_name], idx, slot, mode, handles, keep)
                    sent.append((name, env[value_name]))
        return recvd, sent, loss, out

    def evaluate(self, loss_of: Callable[..., Tensor], inputs: Sequence[Tensor],
                 targets: Tensor, *, compress: bool = False) -> tuple[float, Any]:
        """A forward of one held-out batch (no gradients, no feedback state read or
        changed); activations through the compressor alone with ``compress``. Returns the
        loss and the model's output on the last rank, (0.0, None) elsewhere."""
        handles: list[Any] = []
        keep: list[Tensor] = []
        self.stage.eval()
        try:
            with torch.no_grad():
                _, _, loss, out = self._forward(
                    inputs, targets, 1.0, None, 0, loss_of,
                    "eval-compressed" if compress else "eval", handles, keep)
            for h in handles:
                h.wait()
        finally:
            self.stage.train()
        return (float(loss) if loss is not None else 0.0), out

    def train_step(self, loss_of: Callable[..., Tensor],
                   inputs: Sequence[Tensor], targets: Tensor, *, micro_batches: int = 1,
                   idx: Tensor | None = None) -> float:
        """One GPipe step on this rank; every rank passes the same batch. Returns the
        batch's loss on the last rank, 0.0 elsewhere."""
        b = int(targets.shape[0])
        parts = [torch.tensor_split(t, micro_batches) for t in inputs]
        tparts = torch.tensor_split(targets, micro_batches)
        iparts = torch.tensor_split(idx, micro_batches) if idx is not None else None
        handles: list[Any] = []
        keep: list[Tensor] = []
        saved: list[tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], Tensor | None]] = []
        total = 0.0
        for m in range(micro_batches):
            mi = iparts[m] if iparts is not None else None
            recvd, sent, loss, _ = self._forward(
                [p[m] for p in parts], tparts[m], tparts[m].shape[0] / b, mi, m, loss_of,
                "train", handles, keep)
            saved.append((recvd, sent, loss))
            if loss is not None:
                total += float(loss.detach())
        for m in reversed(range(micro_batches)):
            recvd, sent, loss = saved[m]
            outs: list[Tensor] = []
            grads: list[Tensor] = []
            if loss is not None:
                outs.append(loss)
                grads.append(torch.ones_like(loss))
            for name, v in sent:
                bd = self.pipe.boundaries[name]
                p, hb = recv_payload(bd.dst, BACKWARD_TAG + self.tags[name], self.link)
                self.header_bytes += hb
                outs.append(v)
                grads.append(bd.grad_recv.decode(p, None, m))
            # an output that needs no gradient (no parameters before it): its gradient
            # was received (the protocol's), and there is nothing to run it into
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            for name, x in recvd:
                bd = self.pipe.boundaries[name]
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                p = bd.grad_send.encode(g, None, m)
                bd.grad_bytes += p.nbytes
                bd.grad_raw += g.numel() * g.element_size()
                self.header_bytes += send_payload(p, bd.src, handles, keep,
                                                  BACKWARD_TAG + self.tags[name], self.link)
        for h in handles:
            h.wait()
        self._sync_ties()
        return total

    def _sync_ties(self) -> None:
        for tie, group in self.tie_groups:
            mine = [name for k, name in tie if k == self.rank]
            if not mine:
                continue
            p = self.stage.get_parameter(mine[0])
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)
            if self.link is not None:
                self.link.block("allreduce", g.numel() * g.element_size(),
                                sorted({k for k, _ in tie}))
            p.grad = g
