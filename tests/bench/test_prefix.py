"""`fmserve bench prefix`: both workloads, cache off and on, in one run; the cache serves part of
the prompts only when on; figures are not asserted, only that they are there; bad arguments are
refused before any model loads."""

import pytest

from fmserve.cli import main


def test_bench_prefix_measures_both_workloads_off_and_on(model_path, tmp_path, one_torch_thread):
    out = tmp_path / "prefix.md"
    rc = main(["bench", "prefix", "--model", str(model_path), "--dtype", "fp32",
               "--num-prompts", "3", "--concurrency", "1", "--turns", "2",
               "--max-new-tokens", "4", "--markdown", str(out)])
    assert rc == 0
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("system", "off"), ("system", "on"),
                                            ("chat", "off"), ("chat", "on")]
    for r in rows:
        cached = int(r[6].split()[0])
        assert (cached > 0) == (r[1] == "on"), r  # later requests reuse the earlier ones' pages
        assert float(r[3]) > 0 and float(r[4]) > 0
    assert all(r[7].endswith("x faster") for r in rows if r[1] == "on")


@pytest.mark.parametrize("args, message", [
    (["--workloads", "radix"], "--workloads takes system, chat"),
    (["--turns", "0"], "--turns must be >= 1"),
])
def test_bench_prefix_refuses_bad_arguments(args, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "prefix", "--model", "/nonexistent.gguf", *args])
