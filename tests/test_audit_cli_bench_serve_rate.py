"""`fmserve bench serve --rate / --poisson-requests` are refused when they make no sense, while
the command line is parsed (argparse: the flag named, exit status 2).

--rate 0 ended the Poisson run in a traceback (expovariate(0) divides by zero, and the
client's ClientClosed surfaced) after the offline baseline and the closed-loop levels had run;
a negative or NaN rate sent every request at once and reported the run as "poisson -1/s" or
"poisson nan/s"; a negative --poisson-requests skipped the Poisson run silently."""

from __future__ import annotations

import pytest

from fmserve.cli import build_parser, main


@pytest.mark.parametrize("flag, value", [("--rate", "0"), ("--rate", "-1"), ("--rate", "nan"),
                                         ("--rate", "inf"), ("--rate", "fast"),
                                         ("--poisson-requests", "-2")])
def test_impossible_poisson_settings_are_refused(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--model", str(tmp_path / "none.gguf"), flag, value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err


def test_sensible_poisson_settings_are_kept():
    args = build_parser().parse_args(["bench", "serve", "--rate", "0.5",
                                      "--poisson-requests", "0"])
    assert args.rate == 0.5 and args.poisson_requests == 0  # 0: closed-loop levels only
