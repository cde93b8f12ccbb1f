"""The CLI's exit codes: bad input 2, a proven infeasible problem 3, no plan
within the time limit 4, each its own so a script can tell them apart; and identical
inputs give identical plan bytes through ``solve --out``."""

from __future__ import annotations

import pytest

from qsync_opt.cli import (
    EXIT_BAD_INPUT,
    EXIT_CODES_HELP,
    EXIT_INFEASIBLE,
    EXIT_TIME_LIMIT,
    build_parser,
    main,
)

SMALL = ["--model", "digits_cnn", "--cluster", "l4x1+t4x1", "--method", "random"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_codes_are_distinct_and_documented(capsys) -> None:
    assert len({0, 1, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_TIME_LIMIT}) == 5
    assert EXIT_BAD_INPUT == 2  # unchanged: scripts rely on it
    for code in (EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_TIME_LIMIT):
        assert f"{code} " in EXIT_CODES_HELP
    for cmd in ([], ["solve"], ["pareto"], ["compare"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "exit codes: 0 done; 2 bad input" in text, cmd
        assert "3 no plan exists" in text and "4 no plan found within the time limit" in text


INFEASIBLE = [
    ["solve", *SMALL, "--target-ms", "0.0001"],
    ["solve", *SMALL, "--target-ms", "0.0001", "--solver", "highs"],
    ["solve", *SMALL, "--target-ms", "0.0001", "--solver", "greedy"],
    ["solve", *SMALL, "--target-ms", "0.0001", "--joint-split"],
    # nothing fits memory: found before the indicator, and by the budget mode's probes
    ["solve", *SMALL, "--mode", "budget", "--budget", "0", "--headroom", "0.99"],
    ["solve", "--model", "resnet50", "--cluster", "v100x1@4096+t4x1@4096", "--method",
     "random", "--solver", "highs"],
    ["pareto", "--model", "resnet50", "--cluster", "v100x1@4096+t4x1@4096", "--method",
     "random", "--points", "2"],
]


@pytest.mark.parametrize("argv", INFEASIBLE, ids=lambda a: " ".join(a[:1] + a[-3:]))
def test_infeasible_exits_3(capsys, tmp_path, argv) -> None:
    out = tmp_path / "out.json"
    code, _, err = run(capsys, *argv, "--out", str(out))
    assert code == EXIT_INFEASIBLE, err
    assert err.startswith("qsync-opt: error: ") and "Traceback" not in err
    assert "time limit" not in err.splitlines()[0]
    assert not out.exists()


TIMED = [
    ["solve", *SMALL, "--solver", s, *extra]
    for s in ("highs", "cbc", "cpsat", "greedy")
    for extra in ([], ["--joint-split"], ["--mode", "budget", "--budget", "0.001"])
]


@pytest.mark.parametrize("argv", TIMED, ids=lambda a: " ".join(a[7:]))
def test_a_time_limit_exits_4(capsys, tmp_path, argv) -> None:
    out = tmp_path / "out.json"
    code, _, err = run(capsys, *argv, "--time-limit", "0.000001", "--out", str(out))
    assert code == EXIT_TIME_LIMIT, err
    assert err.count("\n") == 1 and "no plan found within 1e-06 s" in err, err
    assert not out.exists()


def test_bad_input_still_exits_2(capsys, tmp_path) -> None:
    for argv in (["solve", *SMALL, "--time-limit", "-1"],
                 ["solve", *SMALL, "--solver", "nope"],
                 ["solve", *SMALL, "--target-ms", "nan"],
                 ["solve", *SMALL, "--time-limit", "²"]):
        code, _, err = run(capsys, *argv, "--out", str(tmp_path / "p.json"))
        assert code == EXIT_BAD_INPUT, (argv, err)
        assert err.count("\n") == 1


def test_the_parser_refuses_with_2() -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["solve", "--no-such-flag"])
    assert info.value.code == EXIT_BAD_INPUT


@pytest.mark.parametrize("solver", ["highs", "cpsat", "greedy"])
def test_solve_out_twice_gives_identical_bytes(capsys, tmp_path, solver) -> None:
    """Two runs of ``solve --out`` on the same inputs write the same bytes (the plan records
    the time limit asked for, not what remained, and no wall time)."""
    texts = []
    for i in range(2):
        out = tmp_path / f"p{i}.json"
        code, _, err = run(capsys, "solve", *SMALL, "--solver", solver, "--time-limit", "120",
                           "--out", str(out))
        assert code == 0, err
        texts.append(out.read_bytes())
    assert texts[0] == texts[1]
    assert b'"option.time_limit_s": 120.0' in texts[0] and b'"wall_s"' not in texts[0]
