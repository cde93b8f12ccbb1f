"""The profiler package's seams: its CostTable algebra imports without torch, and the
package's names that need torch are its submodules' own, imported when first used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import qsync_opt.profile as prof
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.costs.tables import fit_cast, median_iqr


def test_the_table_algebra_imports_without_torch() -> None:
    """With torch made unimportable, ``qsync_opt.costs.tables`` (and the package, for its
    torch-free names) still import and compute; a name that needs torch fails on use only."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        from qsync_opt.costs.tables import derive, fit_cast, median_iqr, merge, with_comm
        from qsync_opt.profile import fit_cast as again
        assert again is fit_cast
        a, b = fit_cast([1.0, 2.0, 3.0], [3.0, 5.0, 7.0])
        assert abs(a - 2.0) < 1e-12 and abs(b - 1.0) < 1e-12, (a, b)
        assert median_iqr([1.0, 2.0, 3.0]) == (2.0, 1.0)
        try:
            from qsync_opt.profile import profile_detailed
        except ImportError:
            pass
        else:
            raise AssertionError("profile_detailed imported without torch")
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_the_package_names_are_the_submodules() -> None:
    from qsync_opt.costs import tables
    from qsync_opt.profile import builders, gloo, orchestrate, timing

    assert prof.profile_detailed is orchestrate.profile_detailed
    assert prof.Profile is orchestrate.Profile
    assert prof.Timer is timing.Timer
    assert prof.measure_comm_local is gloo.measure_comm_local
    assert prof.OpBuilder is builders.OpBuilder
    assert prof.merge is tables.merge
    assert set(prof.__all__) == {n for n in prof.__all__ if getattr(prof, n, None) is not None}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        prof.nothing  # noqa: B018


def test_the_profile_command_keeps_its_description() -> None:
    """``qsync-opt profile --help`` opens with the package docstring's first line."""
    from qsync_opt.cli.parsers.profile import DESCRIPTION

    assert (prof.__doc__ or "").split("\n\n")[0] == DESCRIPTION


@pytest.mark.parametrize("samples, expected", [
    ([4.0], (4.0, 0.0)),
    ([1.0, 3.0], (2.0, 1.0)),
    ([0.0, 0.0, 0.0, 0.0], (0.0, 0.0)),
    ([1.0, 2.0, 3.0, 4.0, 100.0], (3.0, pytest.approx((52.0 - 1.5) / 3.0))),
])
def test_median_iqr(samples: list[float], expected: tuple[float, float]) -> None:
    """The median, and the spread as interquartile range over median (the full range below
    four samples; 0 when the median is 0)."""
    assert median_iqr(samples) == expected


def test_fit_cast_refuses_what_cannot_be_fitted() -> None:
    with pytest.raises(QsyncInputError, match="at least two"):
        fit_cast([1.0], [2.0])
    with pytest.raises(QsyncInputError, match="must not all be equal"):
        fit_cast([2.0, 2.0], [1.0, 3.0])
