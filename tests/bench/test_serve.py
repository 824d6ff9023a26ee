"""`fmserve bench serve`: a tiny run end to end (a real service started twice, overlap on and
off, against the offline engine), and the overlap summary's arithmetic."""

import re

import pytest

from fmserve.bench.serve import RequestTiming, RunResult, service_variants
from fmserve.bench.serve_rounds import (alternate, overlap_summary, pool_rounds, round_ratios,
                                        run_order)
from fmserve.cli import build_parser, main


def bench_serve_tables(tmp_path, model_path, *flags: str) -> tuple[str, list[str]]:
    """A tiny real `fmserve bench serve --overlap on,off` run: its markdown and table rows."""
    md = tmp_path / "serve.md"
    assert main(["bench", "serve", "--model", str(model_path), "--dtype", "fp32",
                 "--concurrency", "2", "--requests-per-level", "2", "--poisson-requests", "0",
                 "--overlap", "on,off", "--markdown", str(md), *flags]) == 0
    text = md.read_text()
    return text, [line for line in text.splitlines() if line.startswith("| overlap")]


def test_bench_serve_overlap_on_off_side_by_side_end_to_end(tmp_path, model_path):
    """One run (each costs two services and the offline baseline): overlap on with
    launch-ahead "prepare" and off, taken side by side twice (--alternate)."""
    text, rows = bench_serve_tables(tmp_path, model_path, "--max-new-tokens", "3",
                                    "--launch-ahead", "prepare", "--alternate", "2")
    assert [r.split("|")[1].strip() for r in rows] == [
        "overlap on (launch-ahead prepare), concurrency 2", "overlap off, concurrency 2"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "4" and float(cells[8]) > 0  # requests (2, twice), output tok/s
        assert 0 <= float(cells[10]) <= 100  # worker idle %
        # the service's CPU time a step: some, and less than the run's wall time a step on the
        # machine's cores (a step of 2 requests and 3 tokens is tens of ms on a CPU)
        assert 0 < float(cells[11]) < 5000, cells
    summary = re.search(r"- concurrency 2: overlap on \(launch-ahead prepare\)/off throughput "
                        r"([\d.]+)x; worker idle ([\d.]+)% on, ([\d.]+)% off; "
                        r"ceiling ([\d.]+)x", text)
    assert summary, text
    assert float(summary.group(1)) > 0 and float(summary.group(4)) >= 1.0
    pairs = re.search(r"- concurrency 2: overlap on \(launch-ahead prepare\)/off by round: "
                      r"([\d.]+)x ([\d.]+)x; median ([\d.]+)x", text)
    assert pairs, text
    first, second, median = (float(pairs.group(i)) for i in (1, 2, 3))
    assert min(first, second) <= median <= max(first, second) and median > 0


def run(name: str, tokens: int, wall: float, idle: float | None,
        cpu_ms: float | None = None) -> RunResult:
    return RunResult(name, [RequestTiming(0.1, [], 1.0, tokens)], wall, idle, cpu_ms)


def test_overlap_summary_pairs_workloads_and_bounds_the_gain():
    lines = overlap_summary([
        run("overlap on, concurrency 8", 110, 1.0, 0.01),
        run("overlap on, poisson 2/s", 50, 1.0, None),
        run("overlap off, concurrency 8", 100, 1.0, 0.2),
        run("overlap off, poisson 2/s", 50, 1.0, 0.1),
        run("overlap on, concurrency 32", 10, 1.0, 0.0),  # no "off" twin: no line
    ])
    assert lines == [
        "- concurrency 8: overlap on/off throughput 1.100x; worker idle 1.0% on, 20.0% off; "
        "ceiling 1.250x",
        "- poisson 2/s: overlap on/off throughput 1.000x",
    ]


def test_overlap_summary_names_each_launch_ahead_mode():
    lines = overlap_summary([
        run("overlap on (launch-ahead off), concurrency 8", 105, 1.0, 0.05),
        run("overlap on (launch-ahead prepare), concurrency 8", 120, 1.0, 0.01),
        run("overlap off, concurrency 8", 100, 1.0, 0.2),
    ])
    assert lines == [
        "- concurrency 8: overlap on (launch-ahead off)/off throughput 1.050x; worker idle "
        "5.0% on, 20.0% off; ceiling 1.250x",
        "- concurrency 8: overlap on (launch-ahead prepare)/off throughput 1.200x; worker idle "
        "1.0% on, 20.0% off; ceiling 1.250x",
    ]


def test_service_variants_run_each_launch_ahead_mode_with_overlap_only():
    assert service_variants("on,off", None) == [(True, None), (False, None)]
    assert service_variants("on,off", "off, prepare") == [(True, "off"), (True, "prepare"),
                                                          (False, None)]
    assert service_variants("off", "on") == [(False, None)]
    with pytest.raises(SystemExit, match="'sideways'"):
        service_variants("on", "off,sideways")


def test_rounds_alternate_the_order_so_every_variant_holds_every_position():
    a, b, c = (True, "off"), (True, "prepare"), (False, None)
    assert run_order([a, c], 1) == [a, c]
    assert run_order([a, c], 4) == [a, c, c, a, a, c, c, a]
    order = run_order([a, b, c], 2)
    assert order == [a, b, c, c, b, a]
    for v in (a, b, c):  # over two rounds, each variant's mean position is the middle one
        positions = [i % 3 for i, w in enumerate(order) if w == v]
        assert sum(positions) == 2


def test_rounds_pool_per_run_and_keep_each_rounds_ratio():
    rounds = [run("overlap on, concurrency 8", 110, 1.0, 0.01, 0.5),
              run("overlap off, concurrency 8", 100, 1.0, 0.03, None),
              run("overlap on, concurrency 8", 90, 1.0, 0.03, 0.7),
              run("overlap off, concurrency 8", 100, 1.0, 0.05, 0.9)]
    pooled = pool_rounds(rounds)
    assert [r.name for r in pooled] == ["overlap on, concurrency 8", "overlap off, concurrency 8"]
    assert [len(r.timings) for r in pooled] == [2, 2]
    assert [r.output_tps for r in pooled] == [100.0, 100.0]  # (110 + 90) / 2 s
    assert [round(r.idle_share, 3) for r in pooled] == [0.02, 0.04]
    # a figure a repeat lacks is left out of its mean, not counted as 0
    assert [round(r.service_cpu_ms, 3) for r in pooled] == [0.6, 0.9]
    assert round_ratios(rounds) == [
        "- concurrency 8: overlap on/off by round: 1.100x 0.900x; median 1.000x"]
    assert round_ratios(rounds[:2]) == ["- concurrency 8: overlap on/off by round: 1.100x"]


def test_alternate_takes_each_run_in_turn_the_order_reversed_every_other_time():
    taken, said = [], []

    def service(s: str) -> list:
        return [(f"{s} {w}", lambda s=s, w=w: taken.append(f"{s}{w}") or len(taken))
                for w in ("c1", "c8")]

    results = alternate([service("A"), service("B")], 3, said.append)
    assert taken == ["Ac1", "Bc1", "Bc1", "Ac1", "Ac1", "Bc1",
                     "Ac8", "Bc8", "Bc8", "Ac8", "Ac8", "Bc8"]
    assert results == list(range(1, 13))  # in the order taken
    assert said[:3] == ["A c1 (1/3) ...", "B c1 (1/3) ...", "B c1 (2/3) ..."]
    assert alternate([service("A")], 1, said.append) == [13, 14] and said[-1] == "A c8 ..."


def test_bad_arguments_are_refused_before_the_baseline(tmp_path, capsys):
    # Every one of these used to run the offline baseline first (minutes): --concurrency 0 and
    # --max-new-tokens 0 then measured nothing, --overlap maybe ran as off, and a bad --set
    # surfaced only when the first service was started.
    model = str(tmp_path / "none.gguf")  # never reached (without the checks: a quick failure)
    for flags, flag in ([["--concurrency", "0"], "--concurrency"],
                        [["--concurrency", "8,"], "--concurrency"],
                        [["--max-new-tokens", "0"], "--max-new-tokens"]):
        with pytest.raises(SystemExit) as info:
            main(["bench", "serve", "--model", model, *flags])
        assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--overlap 'maybe'"):
        service_variants("maybe", None)
    assert main(["bench", "serve", "--model", model, "--set", "runtime.page_sise=8"]) == 2
    assert "did you mean runtime.page_size" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not both"):
        main(["bench", "serve", "--model", model, "--rounds", "2", "--alternate", "2"])
    assert main(["bench", "serve", "--model", model, "--dtype", "bf17"]) == 2
    assert 'model.dtype = "bf17"' in capsys.readouterr().err


# ----- --rate and --poisson-requests refused while parsing -----
# `fmserve bench serve --rate / --poisson-requests` are refused when they make no sense, while
# the command line is parsed (argparse: the flag named, exit status 2).
#
# --rate 0 ended the Poisson run in a traceback (expovariate(0) divides by zero, and the
# client's ClientClosed surfaced) after the offline baseline and the closed-loop levels had run;
# a negative or NaN rate sent every request at once and reported the run as "poisson -1/s" or
# "poisson nan/s"; a negative --poisson-requests skipped the Poisson run silently.

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
