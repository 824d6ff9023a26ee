"""The torch paged-attention backend against the float64 reference of tests/gpu/attention_cases,
on the batches continuous batching makes: decodes alone, prefill chunks alone, and both mixed
in one EXTEND batch (run as two groups, so a decode is not padded to the longest chunk)."""

import pytest
import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from tests.gpu.attention_cases import BF16, DEVICE, FP32, MIXED_LENS, SMOL, build_case, run_and_compare

# Two decodes on long prefixes, a chunk on a cached prefix, a fresh prompt, one more decode.
MIXED_STEP = dict(seq_lens=[301, 65, 140, 2, 33], prefix_lens=[300, 40, 0, 1, 32])


@pytest.mark.parametrize("dtypes,atol", [(FP32, 1e-4), (BF16, 2e-2)])
def test_decode(dtypes, atol):
    run_and_compare(TorchAttentionBackend, atol, seq_lens=MIXED_LENS,
                    prefix_lens=[n - 1 for n in MIXED_LENS], page_size=16, decode=True,
                    **SMOL, **dtypes)


@pytest.mark.parametrize("dtypes,atol", [(FP32, 1e-4), (BF16, 2e-2)])
def test_prefill_chunks(dtypes, atol):
    run_and_compare(TorchAttentionBackend, atol, seq_lens=[65, 7, 170, 4],
                    prefix_lens=[40, 0, 100, 2], page_size=16, decode=False, **SMOL, **dtypes)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtypes,atol", [(FP32, 1e-4), (BF16, 2e-2)])
def test_decodes_and_chunks_in_one_extend(page_size, dtypes, atol):
    run_and_compare(TorchAttentionBackend, atol, page_size=page_size, decode=False,
                    **MIXED_STEP, **SMOL, **dtypes)


def test_a_mixed_extend_runs_decodes_apart_from_chunks():
    backend, batch, *_ = build_case(TorchAttentionBackend, page_size=16, decode=False,
                                    **MIXED_STEP, **SMOL, **FP32)
    backend.init_forward_metadata(batch)
    decode, chunks = backend._groups
    assert decode.decode and decode.size == 3 and decode.max_len == 301
    assert decode.tokens.tolist() == [0, 166, 167]  # the decodes' token rows
    assert not chunks.decode and chunks.size == 2 and chunks.max_len == 140
    assert chunks.query_index.shape == (2, 140)  # padded to the longest chunk only
    assert chunks.tokens.tolist() == list(range(1, 166))
    if DEVICE.type == "cpu":
        # On a CPU the chunks attend one request at a time over exactly their own keys: the one
        # on a 40-token prefix with a bottom-right causal mask, the fresh prompt plainly causal.
        on_prefix, fresh = chunks.ragged
        assert (on_prefix.start, on_prefix.length, len(on_prefix.key_locs)) == (0, 25, 65)
        assert on_prefix.mask[0].sum() == 41 and on_prefix.mask[-1].all()
        assert (fresh.start, fresh.length, len(fresh.key_locs), fresh.mask) == (25, 140, 140, None)
    else:  # on a GPU one padded launch beats a loop of small ones
        assert chunks.ragged is None
    # a batch of one kind is one group over every token
    backend2, batch2, *_ = build_case(TorchAttentionBackend, seq_lens=[5, 9], prefix_lens=[4, 8],
                                      page_size=16, decode=False, **SMOL, **FP32)
    backend2.init_forward_metadata(batch2)
    assert len(backend2._groups) == 1 and backend2._groups[0].tokens is None


@pytest.mark.parametrize("window", [1, 8, 100, 301])
def test_sliding_window(window):
    # Decodes past the window, chunks on a prefix longer than it, a prompt shorter than it.
    run_and_compare(TorchAttentionBackend, 1e-4, page_size=16, decode=False,
                    sliding_window=window, **MIXED_STEP, **SMOL, **FP32)
    run_and_compare(TorchAttentionBackend, 1e-4, seq_lens=MIXED_LENS,
                    prefix_lens=[n - 1 for n in MIXED_LENS], page_size=16, decode=True,
                    sliding_window=window, **SMOL, **FP32)


@pytest.mark.parametrize("window,hides_keys", [(100, True), (301, False), (4096, False)])
def test_a_window_no_shorter_than_every_sequence_attends_as_full_attention(window, hides_keys):
    """Gemma 3's 512-token window over prompts shorter than it hides nothing: those layers take
    the full-attention groups (on a CPU the chunks one request at a time, not padded under a
    window mask: a third of a 32-prompt prefill's attention time)."""
    backend, batch, *_ = build_case(TorchAttentionBackend, page_size=16, decode=False,
                                    sliding_window=window, **MIXED_STEP, **SMOL, **FP32)
    backend.init_forward_metadata(batch)
    full = TorchAttentionBackend._build_groups(backend, batch, None)
    decode, chunks = backend._groups_by_window[window]
    assert torch.equal(decode.mask, full[0].mask) != hides_keys
    if DEVICE.type == "cpu":
        assert (chunks.ragged is None) == hides_keys and (full[1].ragged is not None)
