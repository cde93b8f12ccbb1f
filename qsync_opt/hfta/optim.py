"""Fused optimizers for horizontally fused training arrays: ``B`` models, one set of ops.

Every fused parameter has the model axis first (``[B, ...]``, :mod:`qsync_opt.hfta`), and
model ``b``'s standalone parameter is the slice ``p[b]``. The optimizers here update all ``B``
models of a parameter with one set of tensor ops: each hyper-parameter is a per-model array
of ``B`` values (a float means the same value for every model), kept in the parameter group
as a float64 CPU tensor ``[B]`` and broadcast along dim 0 as ``[B, 1, 1, ...]`` when a step
runs. No Python loop runs over the models.

* :class:`FusedSGD` equals, for every model ``b``, :class:`torch.optim.SGD` with model
  ``b``'s ``lr`` / ``momentum`` / ``dampening`` / ``weight_decay`` applied to ``p[b]``
  (weight decay added to the gradient, the momentum buffer set to a clone of the first
  gradient, dampening, Nesterov).
* :class:`FusedAdamW` equals :class:`torch.optim.AdamW` per model (decoupled weight decay
  ``p -= lr * wd * p``, bias corrections from the model's own step count, AMSGrad).

``step(closure=None, mask=None)``: ``mask`` is an optional bool tensor ``[B]``; a model whose
entry is False is left completely untouched by this step -- its parameter slices, its
momentum / moment buffers and its step count (e.g. its loss was not finite). Every state
tensor therefore carries per-model step counts (``state["step"]``, float64 ``[B]``), so the
models' AdamW bias corrections may differ. As in torch, a parameter whose ``grad`` is None
is skipped entirely (its state is neither created nor advanced).

Learning rates are per-model arrays that a schedule drives: :meth:`FusedSGD.set_lr` /
:meth:`FusedAdamW.set_lr`, or the ``lr`` attribute (the schedules:
:mod:`qsync_opt.hfta.lr_schedules`). ``state_dict()`` / ``load_state_dict()``
round-trip the hyper-parameter arrays with the state, so a resumed run continues exactly.

Bad input (an array of the wrong length, a value out of range: :mod:`qsync_opt.hfta.hyperparams`;
a parameter without the leading model axis) raises
:class:`~qsync_opt.core.errors.QsyncInputError` naming the field.
"""


from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.hfta.hyperparams import (
    F64,
    Params,
    PerModel,
    PerModelBetas,
    check_fused_count,
    per_model,
    per_model_betas,
    shape_text,
    step_mask,
)

__all__ = ["CHUNK_ELEMENTS", "FusedAdamW", "FusedOptimizer", "FusedSGD"]


def _bshape(B: int, p: Tensor) -> tuple[int, ...]:
    return (B,) + (1,) * (p.dim() - 1)


#: The fast paths step a large parameter in column slices of about this many elements (all
#: ``B`` models at once: ``[B, cols]`` of the ``[B, n]`` view), so that each slice's passes
#: and temporaries stay in cache: a step is memory-bound, and over a whole parameter of
#: hundreds of MB its ops would each stream it through memory again. Element-wise, so the
#: result is the same bit for bit (tests/hfta/test_hfta_optim.py). 0 turns it off.
CHUNK_ELEMENTS = 1 << 16


def _slices(B: int, tensors: Sequence[Tensor],
            scalars: Sequence[Tensor]) -> Iterable[tuple[list[Tensor], list[Tensor]]]:
    """``(tensors, scalars)`` slices for a fast path: the whole tensors with their per-model
    scalars shaped ``[B, 1, ...]`` when they are small (or not all contiguous), else column
    slices of their ``[B, n]`` views with the scalars as ``[B, 1]``."""
    t0 = tensors[0]
    n = t0.numel() // B if B else 0
    chunk = CHUNK_ELEMENTS
    if (chunk <= 0 or t0.numel() <= 2 * chunk
            or not all(t.is_contiguous() for t in tensors)):
        shape = _bshape(B, t0)
        yield list(tensors), [s.view(shape) for s in scalars]
        return
    cols = max(1, chunk // B)
    flat = [t.view(B, n) for t in tensors]
    col = [s.view(B, 1) for s in scalars]
    for j in range(0, n, cols):
        yield [f[:, j:j + cols] for f in flat], col


class _Arrays:
    """A group's per-model arrays on one (device, dtype), cached for one step call."""

    def __init__(self, group: dict[str, Any], keys: Sequence[str]) -> None:
        self.group = group
        self.keys = keys
        self.cache: dict[tuple[torch.device, torch.dtype, str], Tensor] = {}
        #: derived per-model scalars by (device, dtype, step counts): AdamW's
        self.scalars: dict[tuple[Any, ...], dict[str, Tensor]] = {}

    def get(self, key: str, device: torch.device, dtype: torch.dtype) -> Tensor:
        k = (device, dtype, key)
        if k not in self.cache:
            if key == "neg_lr":
                self.cache[k] = self.get("lr", device, dtype).neg()
            else:
                self.cache[k] = self.group[key].to(device=device, dtype=dtype)
        return self.cache[k]


# ----------------------------------------------------------------------------- base class

class FusedOptimizer(torch.optim.Optimizer):
    """What both fused optimizers share: the model count, per-model arrays in every group,
    the leading-``B`` check, the step mask, ``set_lr`` and the state-dict round trip."""

    _ARRAY_KEYS: tuple[str, ...] = ()

    def __init__(self, params: Params, B: int, defaults: dict[str, Any]) -> None:
        self.B = check_fused_count(B, type(self).__name__)
        if isinstance(params, Tensor):
            params = [params]
        super().__init__(params, defaults)

    # -- groups -------------------------------------------------------------------------
    def _normalize(self, group: dict[str, Any]) -> None:
        """Turn the group's hyper-parameters into validated per-model arrays (in place)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, after checking every parameter has the leading model
        axis ``B`` and turning the group's hyper-parameters into per-model arrays."""
        owner = type(self).__name__
        params = param_group["params"]
        plist = [params] if isinstance(params, Tensor) else list(params)
        for item in plist:
            name, p = item if isinstance(item, tuple) else (None, item)
            if not isinstance(p, Tensor):
                continue  # torch's own check names it
            what = f"parameter {name!r}" if name is not None else "a parameter"
            if p.dim() < 1 or p.shape[0] != self.B:
                raise QsyncInputError(
                    f"{owner}: every parameter needs the model axis first (leading dim "
                    f"B={self.B}), got {what} of shape {shape_text(p)}")
            if not p.is_floating_point():
                raise QsyncInputError(f"{owner}: {what} of shape {shape_text(p)} is {p.dtype}; "
                                      f"only real floating-point parameters are supported")
        group = dict(param_group)
        group["params"] = plist
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        self._normalize(group)
        super().add_param_group(group)

    def _group_arrays(self, group: dict[str, Any]) -> _Arrays:
        self._normalize(group)  # a caller may have assigned group["lr"] = 0.1 etc.
        return _Arrays(group, self._ARRAY_KEYS)

    # -- learning rates -------------------------------------------------------------------
    def set_lr(self, lrs: PerModel, group: int | None = None) -> None:
        """Set every model's learning rate (``B`` values, or one for all) in every group, or
        in group index ``group`` only. The arrays are replaced, never written in place, so a
        state dict taken before keeps its rates."""
        arr = per_model(lrs, self.B, f"{type(self).__name__}.set_lr: lr")
        groups = self.param_groups if group is None else [self.param_groups[group]]
        for g in groups:
            g["lr"] = arr.clone()

    @property
    def lr(self) -> Tensor:
        """The first parameter group's per-model learning rates (float64 ``[B]``, a copy)."""
        return self.param_groups[0]["lr"].clone()

    @lr.setter
    def lr(self, lrs: PerModel) -> None:
        self.set_lr(lrs)

    # -- state dict -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with the groups' per-model arrays copied (a later ``set_lr``
        or step never changes a state dict already taken)."""
        sd = super().state_dict()
        sd["param_groups"] = [
            {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in g.items()}
            for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; the saved per-model arrays are checked against this
        optimizer's ``B`` (QsyncInputError) and restored with the state."""
        owner = type(self).__name__
        for i, g in enumerate(state_dict.get("param_groups", [])):
            probe = dict(g)
            try:
                self._normalize(probe)
            except QsyncInputError as e:
                raise QsyncInputError(f"{owner}.load_state_dict: param group {i}: {e}") from None
        super().load_state_dict(state_dict)
        self.__dict__.pop("_all_started", None)  # recomputed from the loaded state
        for g in self.param_groups:
            self._normalize(g)
        for p, st in self.state.items():
            if isinstance(p, Tensor) and "step" in st:
                st["step"] = st["step"].to(device=p.device, dtype=F64)

    # -- step -----------------------------------------------------------------------------
    def _fused_step(self, group: dict[str, Any], arrays: _Arrays, p: Tensor, grad: Tensor,
                    m: Tensor | None) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             mask: Tensor | Sequence[bool] | None = None) -> Any:
        """One step for every model (or only those with ``mask`` True; the others are left
        untouched: parameters, buffers, step counts). Returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner = type(self).__name__
        m_cpu = step_mask(mask, self.B, owner)
        if m_cpu is not None:
            if not bool(m_cpu.any()):
                return loss
            if bool(m_cpu.all()):
                m_cpu = None
        masks: dict[torch.device, Tensor] = {}
        for group in self.param_groups:
            arrays = self._group_arrays(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise QsyncInputError(f"{owner}: sparse gradients are not supported "
                                          f"(parameter of shape {shape_text(p)})")
                m = None
                if m_cpu is not None:
                    if p.device not in masks:
                        masks[p.device] = m_cpu.to(p.device)
                    m = masks[p.device]
                self._fused_step(group, arrays, p, p.grad, m)
        return loss


def _commit(dst: Tensor, new: Tensor, m: Tensor | None) -> None:
    """``dst = new`` for the models in mask ``m`` (broadcast ``[B, 1, ...]``; all if None)."""
    if m is None:
        dst.copy_(new)
    else:
        dst.copy_(torch.where(m, new, dst))


# ----------------------------------------------------------------------------- SGD

class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, weight decay, Nesterov) for ``B`` fused models.

    ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are each a float (every model)
    or ``B`` values (a sequence or a 1-D tensor). Model ``b``'s update of ``p[b]`` equals
    :class:`torch.optim.SGD` with model ``b``'s values. ``nesterov`` is one flag for all and
    needs every model's momentum > 0 and dampening 0 (as torch).

    State per parameter: ``step`` (float64 ``[B]``, the steps each model took),
    ``momentum_buffer`` (like the parameter) and ``momentum_started`` (``[B]``, 1 once model
    ``b``'s buffer holds its first gradient) once any model has momentum."""

    _ARRAY_KEYS = ("lr", "momentum", "dampening", "weight_decay")
    #: The two-op path for the common case (momentum everywhere, no dampening, no
    #: Nesterov, no mask); False forces the general path (tests and timing compare them).
    fast_path = True

    def __init__(self, params: Params, B: int,
                 lr: PerModel, momentum: PerModel = 0.0, weight_decay: PerModel = 0.0,
                 dampening: PerModel = 0.0, nesterov: bool = False) -> None:
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": bool(nesterov)}
        B = check_fused_count(B, "FusedSGD")
        self.B = B
        probe = dict(defaults)
        self._normalize(probe)  # refuse bad defaults before any group is built
        super().__init__(params, B, probe)

    def _normalize(self, group: dict[str, Any]) -> None:
        B = self.B
        group["lr"] = per_model(group["lr"], B, "FusedSGD lr")
        group["momentum"] = per_model(group["momentum"], B, "FusedSGD momentum")
        group["dampening"] = per_model(group["dampening"], B, "FusedSGD dampening",
                                        lo=-math.inf)
        group["weight_decay"] = per_model(group["weight_decay"], B,
                                           "FusedSGD weight_decay")
        group["nesterov"] = bool(group.get("nesterov", False))
        if group["nesterov"] and (bool((group["momentum"] <= 0).any())
                                  or bool((group["dampening"] != 0).any())):
            raise QsyncInputError("FusedSGD nesterov: Nesterov momentum needs every model's "
                                  "momentum > 0 and dampening 0, got momentum "
                                  f"{group['momentum'].tolist()} and dampening "
                                  f"{group['dampening'].tolist()}")

    def _fused_step(self, group: dict[str, Any], arrays: _Arrays, p: Tensor, grad: Tensor,
                    m_b: Tensor | None) -> None:
        B, dev, dt = self.B, p.device, p.dtype
        shape = _bshape(B, p)
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros(B, dtype=F64, device=dev)
        m = None if m_b is None else m_b.view(shape)
        flags = getattr(arrays, "flags", None)
        if flags is None:  # once per group and step, not per parameter
            mom0 = group["momentum"]
            flags = arrays.flags = {  # type: ignore[attr-defined]
                "wd": bool((group["weight_decay"] != 0).any()),
                "mom_any": bool((mom0 != 0).any()),
                "plain": bool((mom0 != 0).all()) and bool((group["dampening"] == 0).all())
                and not group["nesterov"]}

        started = self.__dict__.setdefault("_all_started", {})  # id(p) -> bool, not state
        if id(p) not in started and "momentum_started" in st:
            started[id(p)] = bool((st["momentum_started"] != 0).all())
        if self.fast_path and m_b is None and flags["plain"] and started.get(id(p), False):
            # the common case, the same arithmetic in two in-place ops: every model has
            # momentum, no dampening, no Nesterov, every buffer started, no mask
            tensors = [p, grad, st["momentum_buffer"]]
            scalars = [arrays.get("momentum", dev, dt), arrays.get("neg_lr", dev, dt)]
            if flags["wd"]:
                scalars.append(arrays.get("weight_decay", dev, dt))
            for (p_, g_, buf), sc in _slices(B, tensors, scalars):
                d = torch.addcmul(g_, p_, sc[2]) if flags["wd"] else g_
                buf.mul_(sc[0]).add_(d)
                p_.addcmul_(buf, sc[1])
            st["step"] += 1
            return

        d_p = grad
        if flags["wd"]:
            d_p = torch.addcmul(grad, p, arrays.get("weight_decay", dev, dt).view(shape))
        if flags["mom_any"]:
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["momentum_started"] = torch.zeros(B, dtype=dt, device=dev)
            buf = st["momentum_buffer"]
            started_b = st["momentum_started"] != 0
            active_b = arrays.get("momentum", dev, dt) != 0
            mom_t = arrays.get("momentum", dev, dt).view(shape)
            one_minus_damp = (1.0 - group["dampening"]).to(device=dev, dtype=dt).view(shape)
            running = torch.addcmul(buf * mom_t, d_p, one_minus_damp)
            new_buf = torch.where(started_b.view(shape), running, d_p)
            new_buf = torch.where(active_b.view(shape), new_buf, buf)
            upd = torch.addcmul(d_p, new_buf, mom_t) if group["nesterov"] else new_buf
            upd = torch.where(active_b.view(shape), upd, d_p)
            new_started = (started_b | active_b).to(dt)
            _commit(buf, new_buf, m)
            _commit(st["momentum_started"], new_started, m_b)
            self.__dict__.setdefault("_all_started", {})[id(p)] = bool(
                (st["momentum_started"] != 0).all())
        else:
            upd = d_p

        neg_lr = arrays.get("lr", dev, dt).neg().view(shape)
        if m is None or m_b is None:
            p.addcmul_(upd, neg_lr)
            st["step"] += 1
        else:
            _commit(p, torch.addcmul(p, upd, neg_lr), m)
            st["step"] += m_b.to(F64)


# ----------------------------------------------------------------------------- AdamW

class FusedAdamW(FusedOptimizer):
    """AdamW (decoupled weight decay, optional AMSGrad) for ``B`` fused models.

    ``lr``, ``eps`` and ``weight_decay`` are each a float or ``B`` values; ``betas`` is one
    pair, ``B`` pairs (a list, or a ``[B, 2]`` tensor) or two per-model arrays
    ``(beta1s, beta2s)`` (see :func:`per_model_betas` for the ``B == 2`` case). Model
    ``b``'s update of ``p[b]`` equals :class:`torch.optim.AdamW` with model ``b``'s values
    and model ``b``'s own step count.

    State per parameter: ``step`` (float64 ``[B]``), ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq`` (each like the parameter)."""

    _ARRAY_KEYS = ("lr", "eps", "weight_decay")
    #: The in-place path for the common case (no mask, no AMSGrad); False forces the
    #: general path, whose arithmetic it repeats op for op (tests compare the two).
    fast_path = True

    def __init__(self, params: Params, B: int,
                 lr: PerModel = 1e-3, betas: PerModelBetas = (0.9, 0.999),
                 eps: PerModel = 1e-8, weight_decay: PerModel = 1e-2,
                 amsgrad: bool = False) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "amsgrad": bool(amsgrad)}
        B = check_fused_count(B, "FusedAdamW")
        self.B = B
        probe = dict(defaults)
        self._normalize(probe)
        super().__init__(params, B, probe)

    def _normalize(self, group: dict[str, Any]) -> None:
        B = self.B
        group["lr"] = per_model(group["lr"], B, "FusedAdamW lr")
        group["betas"] = per_model_betas(group["betas"], B, "FusedAdamW betas")
        group["eps"] = per_model(group["eps"], B, "FusedAdamW eps")
        group["weight_decay"] = per_model(group["weight_decay"], B,
                                           "FusedAdamW weight_decay")
        group["amsgrad"] = bool(group.get("amsgrad", False))

    def _fused_step(self, group: dict[str, Any], arrays: _Arrays, p: Tensor, grad: Tensor,
                    m_b: Tensor | None) -> None:
        B, dev, dt = self.B, p.device, p.dtype
        shape = _bshape(B, p)
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros(B, dtype=F64, device=dev)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"] and "max_exp_avg_sq" not in st:
            st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        m = None if m_b is None else m_b.view(shape)

        step = st["step"] + (1.0 if m_b is None else m_b.to(F64))
        sc = _adamw_scalars(group, arrays, step, dev, dt)
        wd = bool((group["weight_decay"] != 0).any())

        if self.fast_path and m_b is None and not group["amsgrad"]:
            # the common case, the same arithmetic as below in place (slice by slice for a
            # large parameter): no mask, no AMSGrad
            for (p_, g_, ea, eas), (decay_, omb1, beta2_, omb2, bc2, eps_, nss) in _slices(
                    B, [p, grad, st["exp_avg"], st["exp_avg_sq"]],
                    [sc[k] for k in ("decay", "one_minus_b1", "beta2", "one_minus_b2",
                                     "bc2_sqrt", "eps", "neg_step_size")]):
                if wd:
                    p_.mul_(decay_)
                ea.lerp_(g_, omb1)
                eas.mul_(beta2_).addcmul_(g_, g_ * omb2)
                denom = eas.sqrt().div_(bc2).add_(eps_)
                p_.addcmul_(ea / denom, nss)
            st["step"].copy_(step)
            return

        decay, eps = sc["decay"].view(shape), sc["eps"].view(shape)
        one_minus_b1, one_minus_b2 = sc["one_minus_b1"].view(shape), sc["one_minus_b2"].view(shape)
        beta2, bc2_sqrt = sc["beta2"].view(shape), sc["bc2_sqrt"].view(shape)
        neg_step_size = sc["neg_step_size"].view(shape)

        new_p = p * decay if wd else p
        exp_avg = torch.lerp(st["exp_avg"], grad, one_minus_b1)
        exp_avg_sq = torch.addcmul(st["exp_avg_sq"] * beta2, grad, grad * one_minus_b2)
        if group["amsgrad"]:
            max_sq = torch.maximum(st["max_exp_avg_sq"], exp_avg_sq)
            denom = (max_sq.sqrt() / bc2_sqrt).add_(eps)
            _commit(st["max_exp_avg_sq"], max_sq, m)
        else:
            denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
        new_p = torch.addcmul(new_p, exp_avg / denom, neg_step_size)

        _commit(st["exp_avg"], exp_avg, m)
        _commit(st["exp_avg_sq"], exp_avg_sq, m)
        _commit(p, new_p, m)
        st["step"].copy_(step)


def _adamw_scalars(group: dict[str, Any], arrays: _Arrays, step: Tensor, dev: torch.device,
                   dt: torch.dtype) -> dict[str, Tensor]:
    """AdamW's per-model scalars (each ``[B]`` in the parameter dtype) at per-model step
    counts ``step``: computed in float64 like torch's Python floats, then cast; cached in
    ``arrays`` (one step call) by the step counts, so parameters at the same counts share
    them."""
    key = (dev, dt, tuple(step.tolist()))
    got = arrays.scalars.get(key)
    if got is not None:
        return got
    lr64 = arrays.get("lr", dev, F64)
    betas64 = arrays.get("betas", dev, F64)
    beta1_64, beta2_64 = betas64[:, 0], betas64[:, 1]
    out = {"decay": (1.0 - lr64 * arrays.get("weight_decay", dev, F64)).to(dt),
           "neg_step_size": (lr64 / (1.0 - beta1_64 ** step)).neg().to(dt),
           "bc2_sqrt": (1.0 - beta2_64 ** step).sqrt().to(dt),
           "one_minus_b1": (1.0 - beta1_64).to(dt),
           "beta2": beta2_64.to(dt),
           "one_minus_b2": (1.0 - beta2_64).to(dt),
           "eps": arrays.get("eps", dev, dt)}
    arrays.scalars[key] = out
    return out
