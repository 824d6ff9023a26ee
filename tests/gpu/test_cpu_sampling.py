"""The sampler's noise and draw in C (gpu/cpu_sampling.py, gpu/csrc/gumbel.c), against torch's
formulas in gpu/seeded_random.py (the documented hash, a uniform, -log(-log u)) and a plain
argmax written here."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_sampling
from gpu.sampler import Sampler
from gpu.sampling_state import F_TEMP, I_GREEDY, SamplingState
from gpu.seeded_random import gumbel_, row_keys, token_terms, uniform_from_terms
from ipc.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_sampling.available(torch.device("cpu")),
                                reason="no C compiler: the sampler keeps torch's noise")


def keys_of(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    seeds[0] = 2**63 - 1  # the largest seed: int64 wrap-around in the key
    return row_keys(seeds, torch.randint(0, 10**6, (rows,), generator=gen))


def torch_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """gpu/seeded_random.py's noise, from the key (seeded_uniform without its key step)."""
    return gumbel_(uniform_from_terms(keys, token_terms(ids)))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_noise_is_torchs_to_a_few_ulps_for_every_token_and_for_candidate_ids(threads):
    keys, vocab = keys_of(5), 20_000  # three of the C loop's 8,192-token chunks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = cpu_sampling.gumbel_noise(keys, None, vocab)
        ids = torch.randint(0, 300_000, (5, 77), generator=torch.Generator().manual_seed(1))
        picked = cpu_sampling.gumbel_noise(keys, ids, 77)
    finally:
        torch.set_num_threads(before)
    want = torch_noise(keys, torch.arange(vocab))
    # The hash and the uniform are exact; only the two logs may differ, by an ulp or so.
    assert (whole - want).abs().max() <= 4e-6
    assert (whole == want).float().mean() > 0.8
    assert (picked - torch_noise(keys, ids)).abs().max() <= 4e-6
    assert torch.equal(cpu_sampling.gumbel_noise(keys, ids[:, :1], 1), picked[:, :1])
    # -log(-log u) for u in [2^-24, 1 - 2^-24]: finite, within [-2.8, 16.7].
    assert whole.min() > -2.9 and whole.max() < 16.7 and torch.isfinite(whole).all()


def test_the_c_noise_has_the_gumbel_distribution():
    noise = cpu_sampling.gumbel_noise(keys_of(4, seed=3), None, 50_000).double().flatten()
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert noise.var().item() == pytest.approx(torch.pi**2 / 6, rel=0.02)
    # its CDF, exp(-exp(-x)), at a few points
    for x in (-1.0, 0.0, 1.0, 3.0):
        share = (noise <= x).double().mean().item()
        assert share == pytest.approx(torch.exp(-torch.exp(torch.tensor(-x))).item(), abs=0.005)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_draw_without_cuts_is_the_argmax_of_the_scaled_logits_plus_the_noise(threads):
    rows, vocab = 7, 20_000
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[3, [17, 9000, 19_999]] = 50.0  # equal largest across chunks: the first one
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 1.0])
    greedy = torch.tensor([False, False, True, True, False, False, False])
    keys = keys_of(rows, seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_sampling.cut_draw(logits, temperatures, keys, greedy)
    finally:
        torch.set_num_threads(before)
    noise = cpu_sampling.gumbel_noise(keys, None, vocab)
    want = [int((noise[r] + logits[r] / temperatures[r]).argmax()) if not greedy[r]
            else int(logits[r].argmax()) for r in range(rows)]
    assert got.tolist() == want
    assert int(got[3]) == 17
    with pytest.raises(TypeError, match="float32"):
        cpu_sampling.cut_draw(logits.bfloat16(), temperatures, keys, greedy)
    with pytest.raises(ValueError, match="per row"):  # the C loop would read past them
        cpu_sampling.cut_draw(logits, temperatures[:3], keys, greedy)
    with pytest.raises(ValueError, match="token ids"):
        cpu_sampling.gumbel_noise(keys, torch.zeros(rows, 3, dtype=torch.long), 5)


def test_a_temperature_only_batch_draws_what_the_torch_path_draws_for_each_row():
    """The one-pass draw (every row temperature-only) against the same rows drawn by the cuts'
    draw (a row with top_k in the batch sends it there): the same tokens."""
    vocab, steps = 3000, 20
    state = SamplingState(8, vocab, "cpu")
    sampler = Sampler(state)
    params = [SamplingParams(seed=10 + s, temperature=t)
              for s, t in enumerate((0.6, 1.0, 1.3, 0.0))]
    for slot, p in enumerate(params, start=1):
        state.set_request(slot, p)
    state.set_request(6, SamplingParams(seed=99, top_k=50))  # its own cut: cut_draw
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        logits = torch.randn(5, vocab, generator=gen) * 2
        positions = torch.full((5,), 40 + step)
        alone = sampler.sample(logits[:4], torch.tensor([1, 2, 3, 4]), positions[:4])
        mixed = sampler.sample(logits, torch.tensor([1, 2, 3, 4, 6]), positions)
        assert alone.token_ids.tolist() == mixed.token_ids[:4].tolist(), step
        assert int(alone.token_ids[3]) == int(logits[3].argmax())  # the greedy row
    flags = state.batch_flags(torch.tensor([1, 2, 3, 4]).numpy())
    assert flags.noise_only and not state.batch_flags(torch.tensor([1, 6]).numpy()).noise_only
    assert not state.batch_flags(torch.tensor([1]).numpy()).all_greedy


CUTS = {
    "top_k": [dict(top_k=k) for k in (1, 2, 40, 700)],
    "top_p": [dict(top_p=p) for p in (0.05, 0.5, 0.9, 0.99)],
    "top_k_and_top_p": [dict(top_k=40, top_p=0.9), dict(top_k=3, top_p=0.99),
                        dict(top_k=500, top_p=0.6), dict(top_k=40, top_p=0.01)],
    "min_p": [dict(min_p=m) for m in (0.01, 0.05, 0.3, 0.9)],
    "all_three": [dict(top_k=40, top_p=0.95, min_p=0.05), dict(top_k=100, top_p=0.8, min_p=0.2),
                  dict(top_p=0.9, min_p=0.1), dict(top_k=20, min_p=0.05)],
}


@pytest.mark.parametrize("kind", sorted(CUTS))
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_the_c_cuts_draw_what_the_torch_cuts_draw(kind, spread):
    """cut_draw (what Sampler.sample runs on a CPU) against Sampler.torch_draw (the GPU's
    topk / sort / logsumexp path) on the same rows: the same token in every row and step. The
    batch also holds a greedy row and a temperature-only row; `spread` moves the cut from the
    whole vocabulary (flat rows) to a few tokens, and makes the C pass widen its gap."""
    vocab, steps = 6000, 12
    state = SamplingState(8, vocab, "cpu")
    sampler = Sampler(state)
    for slot, cut in enumerate(CUTS[kind], start=1):
        state.set_request(slot, SamplingParams(seed=slot, temperature=0.6 + 0.2 * slot, **cut))
    state.set_request(5, SamplingParams(temperature=0.0))
    state.set_request(6, SamplingParams(seed=7, temperature=1.1))
    slots = torch.arange(1, 7)
    flags = state.batch_flags(slots.numpy())
    fp, ip = state.float_params[slots], state.int_params[slots]
    gen = torch.Generator().manual_seed(int(spread * 10))
    for step in range(steps):
        logits = torch.randn(6, vocab, generator=gen) * spread
        positions = torch.arange(6) + 100 * step
        got = sampler.sample(logits, slots, positions).token_ids
        scaled = logits / fp[:, F_TEMP, None]
        want = sampler.torch_draw(scaled, fp, ip, positions, flags)
        want = torch.where(ip[:, I_GREEDY].bool(), logits.argmax(-1), want)  # top_k 1 too
        assert got.tolist() == want.tolist(), step


@pytest.mark.parametrize("isa", ["avx2", "c"])
def test_the_c_cuts_draw_alike_in_every_build(isa):
    """cut_draw's AVX2 and plain-C gathers (the tests above run this CPU's own build) draw the
    same tokens as the native build, for every cut of CUTS over flat and peaked rows."""
    rows, vocab = 20, 3000
    gen = torch.Generator().manual_seed(3)
    settings = [c for kind in sorted(CUTS) for c in CUTS[kind]]
    top_k = torch.tensor([c.get("top_k", 0) for c in settings])
    top_p = torch.tensor([c.get("top_p", float("inf")) for c in settings])
    log_min_p = torch.tensor([c.get("min_p", 0.0) for c in settings]).log()
    temperatures = torch.linspace(0.3, 2.0, rows)
    greedy = torch.zeros(rows, dtype=torch.bool)
    for spread in (0.5, 3.0, 12.0):
        logits = torch.randn(rows, vocab, generator=gen) * spread
        for draw in range(4):
            keys = keys_of(rows, seed=draw)
            for cuts in ((top_k, top_p, log_min_p), None):  # and every row without a cut
                built, native = (cpu_sampling.cut_draw(logits, temperatures, keys, greedy, cuts,
                                                       isa=build) for build in (isa, "native"))
                assert built.tolist() == native.tolist(), (spread, draw, cuts is None)


def test_the_c_cuts_refuse_rows_of_the_wrong_shape():
    logits, one = torch.zeros(3, 10), torch.ones(3)
    with pytest.raises(ValueError, match="one top_k, top_p and log_min_p per row"):
        cpu_sampling.cut_draw(logits, one, one.long(), one, cuts=(torch.zeros(2), one, one))
    with pytest.raises(TypeError, match="float32"):
        cpu_sampling.cut_draw(logits.double(), one, one.long(), one)


@pytest.mark.parametrize("rows,isa", [(1, "native"), (5, "native"), (32, "native"),
                                      (5, "avx2"), (32, "avx2"), (32, "c")])
def test_the_lm_heads_draw_is_the_draw_from_its_written_logits(rows, isa):
    """cpu_sampling.lm_head_draw (the 8-bit lm_head drawing tile by tile, skipping the noise of
    tiles whose hashed uniforms cannot lift them to the best) against cut_draw over the product
    q8_matmul writes, in each build (AVX-512, AVX2 and plain C test the hashes apart)."""
    from gpu.codes_layout import Q8Rows
    from gpu.cpu_q4_kernel import q8_matmul
    gen = torch.Generator().manual_seed(rows)
    vocab, width = 5000, 128  # 5,000 rows: the last group of 16 padded
    weight = torch.randn(vocab, width, generator=gen)
    weight[:40] *= 4  # a few tokens far ahead, as a language model's are: most tiles skipped
    head = Q8Rows.quantize(weight)
    x = torch.randn(rows, width, generator=gen) * 0.3  # logits ~N(0, 3.4), the 40 ~N(0, 14)
    temperatures = torch.tensor([0.05, 0.7, 1.0, 3.0, 1.0] * 7)[:rows]
    greedy = (torch.arange(rows) % 5 == 4) if rows > 1 else torch.tensor([False])
    logits = q8_matmul(x, head)
    assert logits.shape == (rows, vocab)
    for draw in range(16):  # 16 draws a row: a wrongly skipped tile wins one of them
        keys = keys_of(rows, seed=100 * rows + draw)
        drawn = cpu_sampling.lm_head_draw(x, head, (temperatures, keys, greedy), isa=isa)
        assert drawn.tolist() == cpu_sampling.cut_draw(logits, temperatures, keys,
                                                       greedy).tolist(), draw
        assert (drawn < vocab).all()
        if rows == 32:  # drawn, not the argmax
            assert not torch.equal(drawn[~greedy], logits.argmax(-1)[~greedy])
