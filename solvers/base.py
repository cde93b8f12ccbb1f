"""The backend protocols and the options every backend accepts (re-exported by
:mod:`qsync_opt.solvers`). Its own module so the backends import it without importing the
registry that imports them.

Two protocols: :class:`Backend`, what every allocator provides (``solve``), and
:class:`ExactBackend`, what an exact backend provides to the driver (:mod:`.driver`) that
runs it: the translation of the formulation (once per call) and one run of one part. The
driver owns everything around those: the deadline, the parts, the memo, the warm start, the
loose-optimum loop and the report.

Options only one backend reads are typed fields of that backend's own options
(:class:`HighsOptions`, :class:`CbcOptions`, :class:`CpSatOptions`, :class:`UniformOptions`,
:class:`DynamicBatchingOptions`). The older spelling, ``SolveOptions(extra={...})`` with
the keys ``highs``, ``cbc``, ``cpsat``, ``cpsat_units``, ``uniform_precision`` and
``batch_multiple``, still works: it fills those fields (an unknown key is refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from qsync_opt.core.errors import QsyncInputError

if TYPE_CHECKING:
    from qsync_opt.solvers.timing import Stopwatch

    from qsync_opt.documents.schemas import Plan, SolveReport
    from qsync_opt.problem.program import AllocationProblem

#: A raw option value handed to a solver unchanged.
RawValue = bool | int | float | str


def _check_params(name: str, params: object, raw: bool) -> None:
    """Refuse, naming ``name``, options that are not a mapping of option names (to plain
    numbers, strings or booleans when ``raw``)."""
    if not isinstance(params, Mapping) or not all(
            isinstance(k, str) and k.isidentifier() for k in params) or (
            raw and not all(isinstance(v, (bool, int, float, str)) for v in params.values())):
        raise QsyncInputError(f"{name}: expected a mapping of option names to values, "
                              f"got {params!r}")


@dataclass(frozen=True)
class HighsOptions:
    """Options only HiGHS reads. ``params``: raw HiGHS options, set after the backend's own
    (e.g. ``{"mip_abs_gap": 0.0}``)."""

    params: Mapping[str, RawValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_params("highs.params", self.params, raw=True)


@dataclass(frozen=True)
class CbcOptions:
    """Options only CBC reads. ``args``: raw CBC command-line options, after the backend's
    own (e.g. ``("allowableGap 0",)``)."""

    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, Sequence) or any(
                not isinstance(a, str) or not a.strip() for a in self.args):
            raise QsyncInputError(f"cbc.args: expected a sequence of CBC options (strings), "
                                  f"got {self.args!r}")
        object.__setattr__(self, "args", tuple(self.args))


#: CP-SAT's default units: the scaled budget and smallest capacity lie between this many
#: units and 10x as many.
CPSAT_UNITS = 1e8


@dataclass(frozen=True)
class CpSatOptions:
    """Options only CP-SAT reads. ``units``: the scaled budget and smallest capacity lie
    between ``units`` and 10x as many (coarse units in tests exercise the inner model);
    ``params``: raw CP-SAT parameters, set after the backend's own."""

    units: float = CPSAT_UNITS
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        units = self.units
        if isinstance(units, bool) or not isinstance(units, (int, float)) or not (
                1.0 <= units <= 1e12):
            raise QsyncInputError(f"cpsat.units (extra cpsat_units): expected a number in "
                                  f"[1, 1e12], got {units!r}")
        _check_params("cpsat.params", self.params, raw=False)


@dataclass(frozen=True)
class UniformOptions:
    """Options only the uniform baseline reads. ``precision``: the weak groups' precision,
    ``"lowest"``, ``"fastest"`` or a precision name."""

    precision: str = "lowest"

    def __post_init__(self) -> None:
        if not isinstance(self.precision, str):
            raise QsyncInputError(f"uniform.precision (extra uniform_precision): expected "
                                  f"lowest, fastest or a precision name, got {self.precision!r}")


@dataclass(frozen=True)
class DynamicBatchingOptions:
    """Options only the dynamic-batching baseline reads. ``batch_multiple``: every batch is
    a multiple of it."""

    batch_multiple: int = 1

    def __post_init__(self) -> None:
        m = self.batch_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise QsyncInputError(f"dynamic_batching.batch_multiple (extra batch_multiple): "
                                  f"expected a positive integer, got {m!r}")


#: The keys of the older ``extra`` spelling: key -> (the typed field, its own field).
_EXTRA_KEYS = {"highs": ("highs", "params"), "cbc": ("cbc", "args"),
               "cpsat": ("cpsat", "params"), "cpsat_units": ("cpsat", "units"),
               "uniform_precision": ("uniform", "precision"),
               "batch_multiple": ("dynamic_batching", "batch_multiple")}


@dataclass(frozen=True)
class SolveOptions:
    """Options every backend accepts (a backend ignores what does not apply, and says so
    in its report's messages), and each backend's own typed options.

    ``hints``: a warm start, choice indices per group (``AllocationProblem.assignment``);
    ``warm_start="greedy"`` makes the exact backends run greedy first and hint its plan.
    ``acceptance``: greedy's move check, ``"replayer"`` (QSync's way) or ``"linear"``.
    ``decompose``: with a fixed target the groups do not interact; solve one small program
    per group (False: one program for all groups, for comparison).
    ``extra``: the older spelling of the backends' own options (see the module's text).
    """

    time_limit_s: float = 60.0
    threads: int = 0  # 0: the backend's default
    seed: int = 0
    rel_gap: float = 1e-6
    warm_start: str | None = None  # None or "greedy"
    hints: dict[str, list[int]] | None = None
    acceptance: str = "replayer"
    decompose: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    #: The limit the caller asked for, kept when a solve inside a call is given only what
    #: remains (:meth:`with_time_left`); None: ``time_limit_s`` is the one asked for. The
    #: plan and the report record the limit asked for, so identical inputs give identical
    #: plan bytes (the time used is the report's ``wall_s``).
    asked_time_limit_s: float | None = None
    highs: HighsOptions = field(default_factory=HighsOptions)
    cbc: CbcOptions = field(default_factory=CbcOptions)
    cpsat: CpSatOptions = field(default_factory=CpSatOptions)
    uniform: UniformOptions = field(default_factory=UniformOptions)
    dynamic_batching: DynamicBatchingOptions = field(default_factory=DynamicBatchingOptions)

    def __post_init__(self) -> None:
        for key, value in self.extra.items():
            if key not in _EXTRA_KEYS:
                raise QsyncInputError(f"extra: unknown key {key!r}; expected one of "
                                      f"{', '.join(_EXTRA_KEYS)}")
            name, own = _EXTRA_KEYS[key]
            object.__setattr__(self, name, dataclasses.replace(getattr(self, name),
                                                               **{own: value}))

    @property
    def asked_limit_s(self) -> float:
        return (self.asked_time_limit_s if self.asked_time_limit_s is not None
                else self.time_limit_s)

    def with_time_left(self, seconds: float) -> SolveOptions:
        """These options with ``seconds`` to run, the limit asked for kept."""
        return dataclasses.replace(self, time_limit_s=seconds,
                                   asked_time_limit_s=self.asked_limit_s)

    def to_json(self) -> dict[str, Any]:
        return {"time_limit_s": self.asked_limit_s, "threads": self.threads, "seed": self.seed,
                "rel_gap": self.rel_gap, "warm_start": self.warm_start,
                "acceptance": self.acceptance, "decompose": self.decompose,
                "hints": self.hints is not None}


@runtime_checkable
class Backend(Protocol):
    """What every allocator provides."""

    name: str
    exact: bool  # proves optimality of the linear model when it reports OPTIMAL

    def is_available(self) -> bool: ...

    def solve(self, problem: AllocationProblem, options: SolveOptions
              ) -> tuple[Plan | None, SolveReport]:
        """The plan (None when there is none) and the report of one solve."""
        ...


@dataclass
class PartResult:
    """One program's outcome (the groups of one part): its assignment (None: none found),
    the bound on its objective and its size."""

    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, TIME_LIMIT, ERROR
    assignment: dict[str, list[int]] | None
    bound: float | None
    n_variables: int = 0
    n_constraints: int = 0
    #: The absolute tolerance (objective units) within which the backend proved an OPTIMAL
    #: (HiGHS's or CBC's absolute gap, CP-SAT's objective rounding); None: exact.
    objective_tol: float | None = None


@dataclass
class Translation:
    """One call's translation of the formulation, as a backend made it: what the driver
    reads of it, and the call it belongs to (a backend subclasses it with its own model).

    ``proof``: why no plan exists, found while translating (no part is then run);
    ``memo_key``: what makes the backend's answer to a program (None: no memo);
    ``report_options``: the backend's own entries of the report's options;
    ``optimal_tol``: how far above its bound an OPTIMAL plan may lie (objective units)."""

    problem: AllocationProblem
    options: SolveOptions
    sw: Stopwatch
    messages: list[str]
    hints: dict[str, list[int]] | None = None
    proof: list[str] = field(default_factory=list)
    memo_key: tuple[Any, ...] | None = None
    report_options: dict[str, Any] = field(default_factory=dict)
    optimal_tol: float = 0.0

    def tag(self, gis: Sequence[int]) -> str:
        """The part's name in messages: its group, or ``all``."""
        return self.problem.groups[gis[0]].name if len(gis) == 1 else "all"


#: Per group, the (unit, choice) pairs a re-solve leaves out.
Forbidden = Mapping[int, frozenset[tuple[int, int]]]


class ExactBackend(Protocol):
    """An exact backend as the driver runs it: it translates the formulation and runs one
    part; the driver does the rest (:func:`.driver.solve_exact`).

    ``requires``: what :meth:`is_available` needs (the report names it when missing);
    ``hint_note``: what the report says of a warm start (None: nothing);
    ``tolerance_name``: what ``PartResult.objective_tol`` is, in the loose-optimum message;
    ``demotion_note``: what happens to the bound of an OPTIMAL kept as FEASIBLE."""

    name: str
    exact: bool

    @property
    def requires(self) -> str: ...

    @property
    def hint_note(self) -> str | None: ...

    @property
    def tolerance_name(self) -> str: ...

    @property
    def demotion_note(self) -> str: ...

    def is_available(self) -> bool: ...

    def translate(self, problem: AllocationProblem, options: SolveOptions, sw: Stopwatch,
                  messages: list[str]) -> Translation:
        """The call's translation (building counted in ``sw.build_s``)."""
        ...

    def run(self, translation: Any, gis: Sequence[int], limit: float,
            start: Mapping[str, Sequence[int]] | None, forbid: Forbidden | None
            ) -> PartResult:
        """One part solved within ``limit`` seconds from ``start``, without the choices
        ``forbid`` names (objective rescaled to what is left)."""
        ...

    def rescale_note(self, translation: Any, gis: Sequence[int], forbid: Forbidden) -> str:
        """How the objective is rescaled for a re-solve without ``forbid``."""
        ...

    def demoted(self, result: PartResult, objective: float) -> PartResult:
        """An OPTIMAL result kept as FEASIBLE (the loose-optimum loop gave up)."""
        ...

    def unproven_note(self, translation: Any, n_variables: int) -> str | None:
        """What the report adds when the call ends FEASIBLE (None: nothing)."""
        ...
