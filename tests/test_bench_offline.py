"""`fmserve bench offline --overlap off,on` measures both and prints their ratio (figures are
not asserted, only that every number is there and finite)."""

import math

from fmserve.cli import main


def test_bench_offline_overlap_off_and_on(model_path, tmp_path, one_torch_thread):
    out = tmp_path / "offline.md"
    rc = main(["bench", "offline", "--model", str(model_path), "--batch-sizes", "1,2",
               "--dtypes", "fp32", "--prompt-len", "16", "--decode-len", "4", "--no-baseline",
               "--overlap", "off,on", "--markdown", str(out)])
    assert rc == 0
    rows = [line.strip("|").split("|") for line in out.read_text().splitlines()[2:]]
    cells = [[c.strip() for c in r] for r in rows]
    assert [(c[1], c[2]) for c in cells] == [("1", "off"), ("1", "on"), ("2", "off"), ("2", "on")]
    for c in cells:
        assert math.isfinite(float(c[3])) and float(c[4]) > 0  # prefill, decode tok/s
    ratios = [c[9] for c in cells if c[2] == "on"]
    assert all(r.endswith("x") and float(r[:-1]) > 0 for r in ratios), ratios
