"""Decode graphs (gpu/decode_graphs.py): the static buffers, buckets and padding rows around
the graph must give exactly the tokens of the plain decode path. On the CPU the graphs are
EagerReplay (the CPU has none), so everything around them is tested; on a GPU the same tests
capture real CUDA graphs (and tests/gpu/test_cuda.py runs the real model with them).

Graphs need the Triton backend, which runs in Triton's interpreter here (slow per launch), so
the model is conftest's tiny_llama (2 random layers of the default model's attention geometry,
a word-level tokenizer): every code path is the real one, only the weights are few."""

from __future__ import annotations

import pytest
import torch

from fmserve.engine import Engine
from gpu.decode_graphs import DecodeGraphs, bucket_sizes
from gpu.forward_batch import ForwardBatch, ForwardMode
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
PROMPTS = [[1, 7, 9, 30], [1, 40, 2, 11, 12, 60, 61], [1, 5], [1, 88, 17, 17, 3, 4, 50, 51, 52],
           [1, 33, 34]]


def test_bucket_sizes_cover_every_batch_up_to_the_largest():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(1) == [1]
    with pytest.raises(ValueError, match="at least 1"):
        bucket_sizes(0)


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    return Engine(model=str(tiny_llama), device=DEVICE, dtype="fp32", attention_backend="triton",
                  max_kv_tokens=1024, max_running_requests=8, cuda_graph_max_batch=0,
                  progress=False)


def greedy(engine: Engine, overlap: bool) -> list[list[int]]:
    """Five requests whose token budgets differ, so the decode batch shrinks 5, 4, ..., 1."""
    engine.overlap = overlap
    params = [SamplingParams(temperature=0.0, max_new_tokens=2 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    out = [c.token_ids for c in engine.generate(PROMPTS, params)]
    assert_accounting_empty(engine)
    return out


def test_padded_replays_give_the_tokens_of_the_plain_decode(engine):
    runner = engine.worker.step  # a PlainStep
    assert runner.decode_graphs is None  # cuda_graph_max_batch = 0: never captured on its own
    plain = greedy(engine, overlap=False)
    assert len({tuple(t) for t in plain}) > 1  # the prompts lead to different outputs
    # Buckets 1, 2, 4: a batch of 5 runs eagerly, 4 / 2 / 1 replay exactly, 3 replays the
    # 4-row graph with one padding row (slot 0, KV location 0) beside live requests.
    graphs = runner.make_decode_graphs(4)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4]
    runner.decode_graphs = graphs
    try:
        assert greedy(engine, overlap=False) == plain
        first = graphs.replays
        assert first >= 4  # batches of 4, 3, 2 and 1 at least
        assert greedy(engine, overlap=True) == plain
        assert graphs.replays >= 2 * first
    finally:
        runner.decode_graphs = None


def decode_batch(runner, rows: list[tuple[int, int, int]]) -> ForwardBatch:
    """A decode batch by hand: (slot, page, position) per request, its token at the position."""
    dev = runner.device
    for slot, page, _ in rows:
        runner.req_to_token.grant_pages(slot, 0, torch.tensor([page], device=dev))
    slots = torch.tensor([r[0] for r in rows], device=dev)
    positions = torch.tensor([r[2] for r in rows], device=dev)
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=slots * 5 + positions,
                        positions=positions, slots=slots, seq_lens=positions + 1,
                        prefix_lens=positions, extend_lens=torch.ones_like(slots),
                        out_cache_loc=runner.req_to_token.req_to_token[slots, positions].long())


@torch.inference_mode()
def test_padding_rows_touch_only_the_padding_page(engine):
    """A 3-request batch in the 4-row graph: the hidden states of the eager forward, the 4th
    row of every static input is padding (not what the previous 4-request replay left there),
    and of the KV pool only the live rows' locations and page 0 are written."""
    runner = engine.worker.state
    graphs = engine.worker.step.make_decode_graphs(4)
    graphs.capture()
    page = runner.page_size
    four = decode_batch(runner, [(1, 3, 2), (2, 5, 0), (3, 4, 7), (4, 6, 1)])
    graphs.run(four)
    three = decode_batch(runner, [(2, 7, 3), (3, 4, 8), (1, 3, 3)])
    runner.attn.init_forward_metadata(three)
    eager, _ = runner.model.hidden_states(three, runner.attn)
    for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:
        b[:page] = 0  # earlier padding rows left page 0 as this one will: clear it to see it
    before = [b.clone() for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer]
    # Four rows multiply in another blocking than three: equal to rounding, not bit for bit.
    torch.testing.assert_close(graphs.run(three), eager, rtol=1e-4, atol=1e-5)
    assert graphs.ints[:, 3].tolist() == graphs.pad[:, 0].tolist()
    after = runner.kv_pool.k_buffer + runner.kv_pool.v_buffer
    written = set()
    for b, a in zip(before, after):
        written |= set(torch.nonzero((a != b).flatten(1).any(1)).flatten().tolist())
    # The live rows rewrote their own locations (to rounding); the padding row only page 0.
    assert written & set(range(page)), "the padding row wrote nothing"
    assert written <= set(range(page)) | set(three.out_cache_loc.tolist()), sorted(written)


def test_graphs_refuse_a_backend_that_reads_host_lengths(tiny_llama):
    engine = Engine(model=str(tiny_llama), device=DEVICE, dtype="fp32", attention_backend="torch",
                    max_kv_tokens=256, max_running_requests=2, progress=False)
    with pytest.raises(ValueError, match="triton"):
        DecodeGraphs(engine.worker.state.model, engine.worker.state.attn, 2)
