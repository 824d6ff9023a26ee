"""Time the C kernels of two source trees on a GGUF's real tensors, in one process, builds
alternated: the working tree's gpu/csrc against a git revision's. Prints each tensor's time
at several row counts in both builds, their ratio, and whether the outputs are bit-identical.

    python scripts/kernel_ab.py --base HEAD~1 [--isa native|avx2] [--model PATH] [TENSOR ...]

Tensors are GGUF names (default: a few of the model's projections and its token_embd, whose
greedy argmax is what a decode step's lm_head runs). --isa avx2 builds both without AVX-512
(the loops an AVX2-only CPU runs; docs/benchmarks.md, "The AVX2-only path").
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu import c_library  # noqa: E402
from gpu.codes_layout import Q4Rows, Q8Rows, codes_rows  # noqa: E402
from gpu.loader.gguf_loader import int4_weight, open_gguf  # noqa: E402

DEFAULT_TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight",
                   "token_embd.weight")
I, P = ctypes.c_int, ctypes.c_void_p


def build(src: Path, out: Path, isa: str) -> ctypes.CDLL:
    flags = c_library.FLAGS + c_library.ISA_FLAGS[isa]
    names = [f.name for f in c_library.SOURCES]
    subprocess.run(["cc", *flags, "-o", str(out), *names], cwd=src, check=True)
    lib = ctypes.CDLL(str(out))
    # Sources before the `narrow` argument (Q8Rows.narrow) are called without it.
    lib.narrow_arg = "int narrow" in (src / "q4_matmul.h").read_text()
    narrow = [I] if lib.narrow_arg else []
    lib.q4_matmul.argtypes = [P, I, I, P, P, P, I, I, P, I]
    lib.q8_matmul.argtypes = [P, I, I, P, P, I, I, *narrow, I, P, I]
    lib.q8_matmul_argmax.argtypes = [P, I, I, P, P, I, I, *narrow, I, I, P, I]
    return lib


def checkout(rev: str, into: Path) -> Path:
    """gpu/csrc as it was at `rev`."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:gpu/csrc"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.split()
    for name in listing:
        blob = subprocess.run(["git", "show", f"{rev}:gpu/csrc/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def codes_form(tensor) -> Q4Rows | Q8Rows:
    """The tensor in the form the worker keeps it (gpu/cpu_q4_kernel.py CodesLinear)."""
    return codes_rows(int4_weight(tensor, *reversed([int(d) for d in tensor.shape])))


def call(lib, w, x: torch.Tensor, y: torch.Tensor, argmax: bool) -> int:
    rows, k, threads = x.shape[0], x.shape[1], torch.get_num_threads()
    if isinstance(w, Q4Rows):
        return lib.q4_matmul(x.data_ptr(), rows, k, w.nibbles.data_ptr(), w.scale.data_ptr(),
                             w.minimum.data_ptr(), int(w.fp16), w.nibbles.shape[0], y.data_ptr(),
                             threads)
    form = (int(w.fp16), w.halves, *([int(w.narrow)] if lib.narrow_arg else []))
    if argmax:
        return lib.q8_matmul_argmax(x.data_ptr(), rows, k, w.codes.data_ptr(),
                                    w.scale.data_ptr(), *form, w.codes.shape[0], w.out,
                                    y.data_ptr(), threads)
    return lib.q8_matmul(x.data_ptr(), rows, k, w.codes.data_ptr(), w.scale.data_ptr(), *form,
                         w.codes.shape[0], y.data_ptr(), threads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision whose gpu/csrc is the baseline")
    p.add_argument("--isa", choices=sorted(c_library.ISA_FLAGS), default="native")
    p.add_argument("--model", default=str(Path.home() / ".cache/fmserve/models"
                                          / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("tensors", nargs="*", default=list(DEFAULT_TENSORS))
    args = p.parse_args()
    if shutil.which("cc") is None:
        sys.exit("kernel_ab.py: needs a C compiler (cc)")
    tensors = {t.name: t for t in open_gguf(Path(args.model)).tensors}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        libs = {"base": build(checkout(args.base, tmp / "base"), tmp / "base.so", args.isa),
                "tree": build(ROOT / "gpu/csrc", tmp / "tree.so", args.isa)}
        for name in args.tensors:
            w = codes_form(tensors[name])
            lm_head = name.startswith("token_embd")
            n = w.nibbles.shape[0] if isinstance(w, Q4Rows) else w.codes.shape[0]
            k = 2 * w.nibbles.shape[1] if isinstance(w, Q4Rows) else w.codes.shape[1]
            for rows in ((1, 8, 32) if lm_head else (1, 8, 9, 32, 128)):
                x = torch.randn(rows, k)
                ys = {tag: torch.empty(rows, dtype=torch.int64) if lm_head
                      else torch.empty(rows, n) for tag in libs}
                for tag, lib in libs.items():
                    assert call(lib, w, x, ys[tag], lm_head) == 0
                times = {tag: [] for tag in libs}
                reps = max(3, int(2e8 / (rows * n * k)))
                for _ in range(args.repeats):
                    for tag, lib in libs.items():
                        start = time.perf_counter()
                        for _ in range(reps):
                            call(lib, w, x, ys[tag], lm_head)
                        times[tag].append((time.perf_counter() - start) / reps * 1e3)
                base, tree = (statistics.median(times[t]) for t in ("base", "tree"))
                same = torch.equal(ys["base"], ys["tree"])
                print(f"{name:26s} {tensors[name].tensor_type.name:5s} {n}x{k} rows {rows:4d}: "
                      f"base {base:8.3f} ms  tree {tree:8.3f} ms  {base / tree:.2f}x  "
                      f"bit-identical={same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
