"""`fmserve bench offline --overlap off,on` and `--q4 off,on` measure both and print their
ratio (figures are not asserted, only that every number is there and finite); `--cuda-graphs
on` falls back to measuring without where there are no CUDA graphs (the CPU)."""

import math

from fmserve.cli import main


def bench_cells(model, tmp_path, *args: str) -> list[list[str]]:
    """Run `fmserve bench offline` on 16-token prompts, 4 decoded tokens; its markdown cells."""
    out = tmp_path / "offline.md"
    rc = main(["bench", "offline", "--model", str(model), "--prompt-len", "16", "--decode-len",
               "4", "--no-baseline", "--markdown", str(out), *args])
    assert rc == 0
    rows = [line.strip("|").split("|") for line in out.read_text().splitlines()[2:]]
    return [[c.strip() for c in r] for r in rows]


def test_bench_offline_overlap_off_and_on(model_path, tmp_path, one_torch_thread):
    cells = bench_cells(model_path, tmp_path, "--batch-sizes", "1,2", "--dtypes", "fp32",
                        "--overlap", "off,on", "--cuda-graphs", "off,on")
    assert [(c[1], c[2]) for c in cells] == [("1", "off"), ("1", "on"), ("2", "off"), ("2", "on")]
    assert {c[3] for c in cells} == {"off"}  # fp32: never the 4-bit codes
    assert {c[4] for c in cells} == {"off"}  # the CPU has no CUDA graphs
    for c in cells:
        assert math.isfinite(float(c[5])) and float(c[6]) > 0  # prefill, decode tok/s
    ratios = [c[11] for c in cells if c[2] == "on"]
    assert all(r.endswith("x") and float(r[:-1]) > 0 for r in ratios), ratios


def test_bench_offline_q4_off_and_on(gguf_path, tmp_path, one_torch_thread):
    cells = bench_cells(gguf_path, tmp_path, "--batch-sizes", "1", "--dtypes", "bf16",
                        "--q4", "off,on")
    assert [(c[1], c[3]) for c in cells] == [("1", "off"), ("1", "on")]
    assert all(float(c[6]) > 0 for c in cells)
    ratio = cells[1][12]
    assert ratio.endswith("x") and math.isfinite(float(ratio[:-1])), ratio


def test_impossible_arguments_are_refused_before_any_work(tmp_path, capsys):
    import pytest

    # Batch 0 failed after the model loaded ("need at least 2 request slots ... got 1"), a
    # negative prompt length silently cut the prompts, and --spec with --num-prompts 0 or a
    # prompt file without "prompt" rows ended in an IndexError or a KeyError traceback.
    for flags, flag in ([["--batch-sizes", "0"], "--batch-sizes"],
                        [["--batch-sizes", "1,x"], "--batch-sizes"],
                        [["--prompt-len", "-5"], "--prompt-len"],
                        [["--decode-len", "0"], "--decode-len"],
                        [["--spec", "chain", "--num-prompts", "0"], "--num-prompts"]):
        with pytest.raises(SystemExit) as info:
            main(["bench", "offline", "--model", str(tmp_path / "none.gguf"), *flags])
        assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    assert main(["bench", "offline", "--spec", "chain", "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: each line needs a 'prompt' string" in capsys.readouterr().err
