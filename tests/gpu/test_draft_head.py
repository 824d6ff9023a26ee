"""EAGLE draft heads: layouts on disk, math against a plain re-implementation, refusals, autograd.

Everything runs on tiny random heads for a hand-built target config, on CPU, in a few seconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu import cpu_q4_kernel
from gpu.eagle.draft_head import DraftHead, DraftHeadError
from gpu.eagle.head_io import load_draft_head, random_draft_head, save_draft_head
from gpu.eagle.vocab_map import build_vocab_map
from gpu.model_config import ModelConfig
from tests.gpu.eagle_reference import dense_causal_attention

H, NH, NKV, HD, L, VOCAB, INTER = 64, 4, 2, 16, 8, 300, 128
EPS, THETA = 1e-5, 10000.0
SEQ_LENS = [5, 3]

EAGLE3_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}
EAGLE_KEYS = {
    "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def target_config(**changes) -> ModelConfig:
    fields = dict(architecture="llama", num_layers=L, hidden_size=H, intermediate_size=INTER,
                  num_heads=NH, num_kv_heads=NKV, head_dim=HD, vocab_size=VOCAB, rms_norm_eps=EPS,
                  rope_theta=THETA, max_context_len=256, tie_word_embeddings=False)
    fields.update(changes)
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(VOCAB, H, generator=g) * 0.5
    lm_head = torch.randn(VOCAB, H, generator=g) * 0.1
    return target_config(), embed, lm_head


def make_head(target, algorithm: str, draft_vocab: int | None = None) -> DraftHead:
    cfg, embed, lm_head = target
    head = random_draft_head(cfg, embed, lm_head, algorithm=algorithm, draft_vocab_size=draft_vocab,
                             seed=3)
    with torch.no_grad():  # norms away from 1 so a skipped or swapped norm shows
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if draft_vocab is not None and draft_vocab < VOCAB:
        counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(5))
        d2t, t2d = build_vocab_map(counts, draft_vocab)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def batch_inputs(width: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    n = sum(SEQ_LENS)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    hidden = torch.randn(n, width, generator=g)
    positions = torch.cat([torch.arange(s) for s in SEQ_LENS])
    return ids, hidden, positions


def attention():
    return dense_causal_attention(NH, NKV, HD ** -0.5, SEQ_LENS)


def run(head: DraftHead, width: int):
    ids, hidden, positions = batch_inputs(width)
    with torch.inference_mode():
        out, logits_hidden = head(ids, hidden, positions, attention())
        return out, head.logits(logits_hidden)


def test_config_widths(target):
    head = make_head(target, "eagle3")
    assert head.config.aux_layer_ids == (1, 3, 4)
    assert head.config.capture_layers == (2, 4, 5)
    assert head.config.input_hidden_size == 3 * H
    assert make_head(target, "eagle").config.input_hidden_size == H


@pytest.mark.parametrize("algorithm, draft_vocab, keys, width",
                         [("eagle3", 200, EAGLE3_KEYS, 3 * H), ("eagle", None, EAGLE_KEYS, H)])
def test_save_load_round_trip(target, tmp_path, algorithm, draft_vocab, keys, width):
    cfg, embed, lm_head = target
    head = make_head(target, algorithm, draft_vocab)
    save_draft_head(head, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == keys
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == [{"eagle3": "LlamaForCausalLMEagle3",
                                     "eagle": "LlamaForCausalLMEagle"}[algorithm]]
    loaded = load_draft_head(tmp_path, cfg, embed, lm_head, "cpu", torch.float32)
    assert loaded.config == head.config
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    for a, b in zip(run(head, width), run(loaded, width)):
        assert torch.equal(a, b)
    # Shipped small: fp16 on disk, close to the fp32 head.
    save_draft_head(head, tmp_path / "fp16", dtype=torch.float16)
    small = load_draft_head(tmp_path / "fp16", cfg, embed, lm_head, "cpu", torch.float32)
    assert load_file(tmp_path / "fp16" / "model.safetensors")["fc.weight"].dtype == torch.float16
    torch.testing.assert_close(run(small, width)[1], run(head, width)[1], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("algorithm, width", [("eagle3", 3 * H), ("eagle", H)])
def test_a_head_given_the_targets_layers_takes_no_table(target, tmp_path, algorithm, width):
    """Where the target keeps its tables as codes (or split by vocabulary), the head is built
    going through the target's embed and lm_head layers: it holds no table of its own and
    gives what a head holding the tables gives."""
    cfg, embed, lm_head = target
    save_draft_head(make_head(target, algorithm, 200 if algorithm == "eagle3" else None),
                    tmp_path)
    with_tables = load_draft_head(tmp_path, cfg, embed, lm_head, "cpu", torch.float32)
    calls = []

    def embed_layer(ids):
        calls.append("embed")
        return torch.nn.functional.embedding(ids, embed)

    def lm_head_layer(x):
        calls.append("lm_head")
        return x @ lm_head.T

    through = load_draft_head(tmp_path, cfg, None, None, "cpu", torch.float32,
                              parallel_target=(embed_layer, lm_head_layer))
    assert through.target_embed is None and through.target_lm_head is None
    for a, b in zip(run(with_tables, width), run(through, width)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert calls[0] == "embed" and ("lm_head" in calls) == (algorithm == "eagle")
    with pytest.raises(DraftHeadError, match="needs the target's embedding"):
        load_draft_head(tmp_path, cfg, None, None, "cpu", torch.float32)


@pytest.mark.skipif(not cpu_q4_kernel.available(), reason="the C kernel is not built here")
def test_an_fp32_head_on_the_8_bit_kernel_stays_close_and_keeps_its_state(target):
    """On a CPU without native bf16 the head's small fp32 forwards run on Q8_0 copies (the C
    kernel, int8 inputs): close to the fp32 head, its state_dict unchanged, wide forwards exact."""
    head = make_head(target, "eagle3", 200)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    exact = run(head, 3 * H)
    assert head.use_int8_for_small_forwards(max_rows=8, fp32_codes=True) > 0
    assert head.state_dict().keys() == state.keys()
    assert all(torch.equal(head.state_dict()[k], v) for k, v in state.items())
    for a, b in zip(run(head, 3 * H), exact):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())
    x = torch.randn(9, 3 * H)  # more rows than max_rows: the fp32 weight itself
    assert torch.equal(head.fc(x), torch.nn.functional.linear(x, head.fc.weight))


@pytest.mark.skipif(not cpu_q4_kernel.available(), reason="the C kernel is not built here")
@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_a_served_fp32_head_keeps_only_its_codes_and_multiplies_wide_forwards_on_them(target,
                                                                                      gemm):
    """Serving keeps the codes only (no fp32 weight beside them): a forward wider than max_rows
    multiplies the dequantized codes, as the target's projections do, in fp32 or in bf16."""
    head = make_head(target, "eagle3", 200)
    exact = run(head, 3 * H)
    linears = head.use_int8_for_small_forwards(max_rows=8, fp32_codes=True, codes_only=gemm)
    kept = [n for n, p in head.named_parameters() if p.dim() == 2]
    assert linears == 9 and kept == [], kept  # fc, q/k/v/o, gate/up/down, lm_head
    assert head.weight_dtype == torch.float32
    x = torch.randn(40, 3 * H)
    dense = head.fc.q8.dequantize()
    want = ((x.bfloat16() @ dense.bfloat16().t()).float() if gemm == "bf16"
            else x @ dense.t())
    torch.testing.assert_close(head.fc(x), want, atol=1e-4, rtol=1e-3)
    for a, b in zip(run(head, 3 * H), exact):  # the whole head stays close to the fp32 one
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())


@pytest.mark.skipif(not cpu_q4_kernel.available(), reason="the C kernel is not built here")
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle"])
def test_an_fp32_head_on_the_dense_kernel_gives_the_heads_outputs(target, algorithm):
    """An explicit fp32 engine serves the head's linears on the dense C kernel's panels (the
    only copy kept), an EAGLE-1 fc with its bias: the fp32 head's outputs up to the order of
    the sums."""
    head = make_head(target, algorithm, 200 if algorithm == "eagle3" else None)
    width = 3 * H if algorithm == "eagle3" else H
    exact = run(head, width)
    linears = head.use_dense_panels()
    assert linears == (9 if algorithm == "eagle3" else 8)  # an EAGLE-1 head scores by the target
    assert [n for n, p in head.named_parameters() if p.dim() == 2] == []
    assert (head.fc.bias is not None) == (algorithm == "eagle")
    for a, b in zip(run(head, width), exact):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ----- an independent re-implementation from the safetensors file, plain torch ops -----

def ref_rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def ref_rope(x, positions):
    """HF rotate-half rope: x [n, heads, hd]."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rotated = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
    return x * cos + rotated * sin


def ref_attention(q, k, v):
    """Per sequence, per head, explicit causal softmax; query head h reads KV head h // group."""
    out = torch.zeros_like(q)
    start = 0
    for s in SEQ_LENS:
        for h in range(NH):
            kvh = h // (NH // NKV)
            qs, ks, vs = q[start:start + s, h], k[start:start + s, kvh], v[start:start + s, kvh]
            scores = qs @ ks.T / math.sqrt(HD)
            scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
            out[start:start + s, h] = scores.softmax(-1) @ vs
        start += s
    return out


def ref_layer(w, p, x, residual, positions):
    n = x.shape[0]
    q = ref_rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, NH, HD), positions)
    k = ref_rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, NKV, HD), positions)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, NKV, HD)
    h = residual + ref_attention(q, k, v).reshape(n, NH * HD) @ w[p + "self_attn.o_proj.weight"].T
    m = ref_rms(h, w[p + "post_attention_layernorm.weight"])
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return h + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def ref_eagle3(w, embed, ids, hidden, positions):
    emb = embed[ids]
    if hidden.shape[-1] != H:
        hidden = hidden @ w["fc.weight"].T
    x = torch.cat([ref_rms(emb, w["midlayer.input_layernorm.weight"]),
                   ref_rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    out = ref_layer(w, "midlayer.", x, hidden, positions)
    return out, ref_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def test_eagle3_matches_reference(target, tmp_path):
    cfg, embed, lm_head = target
    head = make_head(target, "eagle3", 200)
    save_draft_head(head, tmp_path)
    w = load_file(tmp_path / "model.safetensors")
    ids, hidden, positions = batch_inputs(3 * H)
    ref_out, ref_logits = ref_eagle3(w, embed, ids, hidden, positions)
    with torch.inference_mode():
        out, logits_hidden = head(ids, hidden, positions, attention())
        logits = head.logits(logits_hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(SEQ_LENS), 200)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # A later step reads the head's own (pre-norm) output, H wide: fc is skipped.
    with torch.inference_mode():
        out2, lh2 = head(ids, out, positions + 1, attention())
        logits2 = head.logits(lh2)
    ref_out2, ref_logits2 = ref_eagle3(w, embed, ids, ref_out, positions + 1)
    torch.testing.assert_close(out2, ref_out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2, ref_logits2, atol=1e-5, rtol=1e-5)


def test_eagle_matches_reference(target, tmp_path):
    cfg, embed, lm_head = target
    head = make_head(target, "eagle")
    save_draft_head(head, tmp_path)
    w = load_file(tmp_path / "model.safetensors")
    ids, hidden, positions = batch_inputs(H)
    x = torch.cat([embed[ids], hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
    ref_out = ref_layer(w, "layers.0.", x, x, positions)  # no input norm on EAGLE-1's layer
    out, logits = run(head, H)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_out @ lm_head.T, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32(target):
    cfg, embed, lm_head = target
    head = make_head(target, "eagle3")
    bf16 = random_draft_head(cfg, embed, lm_head, seed=3, dtype=torch.bfloat16)
    bf16.load_state_dict(head.state_dict())
    out32, logits32 = run(head, 3 * H)
    ids, hidden, positions = batch_inputs(3 * H)
    with torch.no_grad():
        out16, lh16 = bf16(ids, hidden.bfloat16(), positions, attention())
        logits16 = bf16.logits(lh16)
    assert out16.dtype == torch.bfloat16 and logits16.dtype == torch.float32
    torch.testing.assert_close(out16.float(), out32, atol=0.1, rtol=0.05)


def test_vocab_map(target):
    counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(9))
    d2t, t2d = build_vocab_map(counts, 120)
    assert d2t.shape == (120,) and d2t.dtype == torch.int64
    assert t2d.shape == (VOCAB,) and int(t2d.sum()) == 120
    kept = t2d.nonzero().flatten()
    assert counts[kept].min() >= counts[~t2d].max()  # the most frequent ids are the ones kept
    head = make_head(target, "eagle3", 120)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    assert torch.equal(head.draft_to_target(torch.arange(120)), kept)
    draft_index = torch.cumsum(t2d.long(), 0)[kept] - 1  # each kept target id's draft id
    assert torch.equal(head.draft_to_target(draft_index), kept)
    full_d2t, full_t2d = build_vocab_map(counts, VOCAB)
    assert not full_d2t.any() and full_t2d.all()


def saved(target, tmp_path, algorithm="eagle3", draft_vocab=200):
    save_draft_head(make_head(target, algorithm, draft_vocab), tmp_path)
    return tmp_path


def refused(path, match: str, **target_changes):
    embed, lm_head = torch.zeros(VOCAB, H), torch.zeros(VOCAB, H)
    cfg = target_config(**target_changes)
    if "vocab_size" in target_changes:
        embed = lm_head = torch.zeros(cfg.vocab_size, H)
    with pytest.raises(DraftHeadError, match=match) as info:
        load_draft_head(path, cfg, embed, lm_head, "cpu", torch.float32)
    return str(info.value)


def test_refuses_mismatched_heads(target, tmp_path):
    path = saved(target, tmp_path / "h")
    assert "hidden_size is 64" in refused(path, "hidden_size", hidden_size=128)
    assert "vocab_size is 300" in refused(path, "vocab_size", vocab_size=320)
    # Aux layers 1, 3, 4 feed the head: a 5-layer target has no layer 4 output to capture.
    refused(path, "aux layer ids", num_layers=5)

    bad_rows = saved(target, tmp_path / "rows")
    raw = json.loads((bad_rows / "config.json").read_text())
    raw["draft_vocab_size"] = 150
    (bad_rows / "config.json").write_text(json.dumps(raw))
    assert "draft_vocab_size 150" in refused(bad_rows, r"'lm_head.weight' has 200 rows")

    missing = saved(target, tmp_path / "missing")
    weights = load_file(missing / "model.safetensors")
    del weights["midlayer.self_attn.k_proj.weight"]
    save_file(weights, missing / "model.safetensors")
    refused(missing, "midlayer.self_attn.k_proj.weight")

    shape = saved(target, tmp_path / "shape", "eagle", None)
    weights = load_file(shape / "model.safetensors")
    weights["layers.0.mlp.up_proj.weight"] = torch.zeros(INTER + 1, H)
    save_file(weights, shape / "model.safetensors")
    refused(shape, r"'layers.0.mlp.up_proj.weight' has shape \(129, 64\)")

    with pytest.raises(DraftHeadError, match="does not exist"):
        load_draft_head(tmp_path / "nowhere", *target, "cpu", torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftHeadError, match="no config.json"):
        load_draft_head(tmp_path / "empty", *target, "cpu", torch.float32)


def test_autograd_reaches_head_not_target(target):
    cfg, embed, lm_head = target
    head = make_head(target, "eagle3", 200).train()
    ids, hidden, positions = batch_inputs(3 * H)
    out, lh = head(ids, hidden, positions, attention())
    out2, lh2 = head(ids, out, positions + 1, attention())  # a second, unrolled step
    labels = torch.randint(0, 200, (ids.shape[0],), generator=torch.Generator().manual_seed(2))
    loss = torch.nn.functional.cross_entropy(head.logits(lh), labels) + \
        torch.nn.functional.cross_entropy(head.logits(lh2), labels)
    loss.backward()
    for p in (head.fc.weight, head.lm_head.weight, head.midlayer.self_attn.q_proj.weight,
              head.midlayer.hidden_norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert not head.target_embed.requires_grad and head.target_embed.grad is None
    assert "target_embed" not in dict(head.named_parameters())
    assert "target_embed" not in head.state_dict()
