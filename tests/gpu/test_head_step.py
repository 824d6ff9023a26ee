"""The EAGLE-3 head's layer in C (gpu/eagle/head_native.py, gpu/csrc/head_step.c): the same
hidden states, normed states and draft-pool KV as the head's torch forward on the same 8-bit
codes, for a decode batch and a causal extend over keys scattered in the pool; the draft
tokens of a served chain unchanged; where it does not apply, it says why."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_q4_kernel
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.eagle import head_native
from gpu.eagle.head_native import NativeHead, why_not
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool
from tests.gpu.test_draft_head import H, HD, NH, NKV, VOCAB, make_head, target_config

pytestmark = pytest.mark.skipif(not cpu_q4_kernel.available(),
                                reason="the C kernel is not built here")

POOL, CONTEXT = 96, 40


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(1)
    return target_config(), torch.randn(VOCAB, H, generator=g) * 0.5, \
        torch.randn(VOCAB, H, generator=g) * 0.1


def _setup(target, kv_dtype=torch.float32):
    head = make_head(target, "eagle3", 200)
    head.use_int8_for_small_forwards(max_rows=16, fp32_codes=True)
    pool = KVPool(1, POOL, 1, NKV, HD, kv_dtype, "cpu")
    table = ReqToTokenPool(3, CONTEXT, 1, "cpu")
    # Two requests' keys scattered over the pool, so a step that read the wrong rows shows.
    locs = torch.randperm(POOL, generator=torch.Generator().manual_seed(4))[:2 * CONTEXT]
    table.req_to_token[1] = locs[:CONTEXT].int()
    table.req_to_token[2] = locs[CONTEXT:].int()
    attn = TorchAttentionBackend(pool, table, NH, NKV, HD, HD ** -0.5, None, None)
    return head, pool, table, attn


def _batch(table, mode, prefix: list[int], extend: list[int], seed: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([1, 2])
    prefix_t, extend_t = torch.tensor(prefix), torch.tensor(extend)
    seq = prefix_t + extend_t
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    rows = torch.repeat_interleave(slots, extend_t)
    return ForwardBatch(
        mode=mode, input_ids=torch.randint(0, VOCAB, (int(extend_t.sum()),), generator=g),
        positions=positions, slots=slots, seq_lens=seq, prefix_lens=prefix_t,
        extend_lens=extend_t, out_cache_loc=table.req_to_token[rows, positions].long(),
        seq_lens_cpu=seq, prefix_lens_cpu=prefix_t, extend_lens_cpu=extend_t,
        seq_lens_sum=int(seq.sum()), max_seq_len=int(seq.max()), max_extend_len=int(extend_t.max()))


def _torch_forward(head, attn, batch, hidden):
    attn.init_forward_metadata(batch)
    with torch.inference_mode():
        return head(batch.input_ids, hidden, batch.positions,
                    lambda q, k, v: attn.forward(q, k, v, 0, batch))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode, extend", [(ForwardMode.DECODE, [1, 1]),
                                          (ForwardMode.EXTEND, [4, 2])])
@pytest.mark.parametrize("rope_table", ["table", "past it"])
def test_the_c_layer_matches_the_torch_forward(target, kv_dtype, mode, extend, rope_table,
                                               monkeypatch):
    if kv_dtype == torch.float16 and not cpu_q4_kernel.library().kv_half_supported():
        pytest.skip("no F16C here")
    if rope_table == "past it":  # positions past the cos / sin table: computed per step
        monkeypatch.setattr(head_native, "ROPE_TABLE_POSITIONS", 6)
    head, pool, table, attn = _setup(target, kv_dtype)
    native = NativeHead(head, pool, attn, max_rows=16)
    # Prefixes written by the torch forward (an extend from the aux states: fc runs).
    prefill = _batch(table, ForwardMode.EXTEND, [0, 0], [7, 5], seed=1)
    _torch_forward(head, attn, prefill, torch.randn(12, 3 * H))
    batch = _batch(table, mode, [7, 5], extend, seed=2)
    hidden = torch.randn(batch.num_tokens, H, generator=torch.Generator().manual_seed(3))
    keep = hidden.clone()
    want_out, want_normed = _torch_forward(head, attn, batch, hidden)
    loc = batch.out_cache_loc
    want_k, want_v = pool.k_buffer[0][loc].clone(), pool.v_buffer[0][loc].clone()
    pool.k_buffer[0][loc] = 0
    pool.v_buffer[0][loc] = 0
    out, normed = native.forward(batch, hidden)
    assert torch.equal(hidden, keep)  # the caller's states are not written
    assert native.runs == 1
    tol = dict(rtol=1e-3, atol=1e-3) if kv_dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(normed, want_normed, **tol)
    torch.testing.assert_close(pool.k_buffer[0][loc].float(), want_k.float(), **tol)
    torch.testing.assert_close(pool.v_buffer[0][loc].float(), want_v.float(), **tol)
    # The same lm_head reads either: the drafted tokens agree.
    assert torch.equal(head.logits(normed).argmax(-1), head.logits(want_normed).argmax(-1))


def test_its_rope_table_holds_the_heads_cos_and_sin(target):
    head, pool, table, attn = _setup(target)
    native = NativeHead(head, pool, attn, max_rows=4)
    positions = torch.tensor([0, 5, native._cos.shape[0] - 1, 3])
    cos, sin = head.rope_tables(positions)
    assert torch.equal(native._cos[positions], cos) and torch.equal(native._sin[positions], sin)


def test_it_takes_what_it_can_run_and_says_why_not(target):
    head, pool, table, attn = _setup(target)
    native = NativeHead(head, pool, attn, max_rows=4)
    small = _batch(table, ForwardMode.EXTEND, [3, 3], [2, 2], seed=1)
    assert native.can_run(small)
    assert not native.can_run(_batch(table, ForwardMode.EXTEND, [3, 3], [3, 2], seed=1))  # 5 rows
    tree = _batch(table, ForwardMode.EXTEND, [3, 3], [2, 2], seed=1)
    tree.tree_mask = torch.ones(2, 2, 2, dtype=torch.bool)  # a tree level: torch's
    assert not native.can_run(tree)
    plain = make_head(target, "eagle3", 200)  # no 8-bit codes: the torch forward
    assert "8-bit codes" in why_not(plain, pool, attn)
    with pytest.raises(ValueError, match="cannot run this head"):
        NativeHead(plain, pool, attn, max_rows=4)


def test_a_chain_drafting_through_the_c_layer_emits_the_plain_greedy_tokens(model_path,
                                                                          monkeypatch):
    """An fp32 engine on the C kernel (what dtype "auto" runs on a CPU without AMX; the suite
    fixes bf16 where the CPU has native bf16), with room for a verify's rows on the codes."""
    monkeypatch.setenv("FMSERVE_CPU_DTYPE", "fp32")
    monkeypatch.setenv("FMSERVE_CPU_CODES_ROWS", "8")
    from fmserve.engine import Engine
    from ipc.sampling import SamplingParams
    from ipc.spec_settings import SpecSettings, accept_length
    spec = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                        disable_above_batch_size=0)
    engine = Engine(model=str(model_path), max_running_requests=2, progress=False, spec=spec)
    native = engine.worker.step.drafter.native
    if native is None:
        pytest.skip("the model's projections are not on the C kernel's codes on this CPU")
    chats = [[{"role": "user", "content": q}]
             for q in ("Name three colors.", "Write a haiku about rain.")]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    outs = engine.generate(chats, params)
    plain = Engine(model=str(model_path), max_running_requests=2, progress=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(chats, params)]
    assert native.runs > 0 and native.max_rows == 8  # the extend over the accepted path too
    steps = sum(o.spec_verify_steps for o in outs)
    accepted = sum(o.spec_accepted_drafts for o in outs)
    # The shipped head accepts ~0.7 drafts a step here; a wrong layer would accept next to none.
    assert accept_length(accepted, steps) >= 1.3, (accepted, steps)
