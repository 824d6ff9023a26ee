"""`fmserve train-eagle`: TTT against a step-by-step chain, and a tiny real run with resume.

The first test uses a small random head and checks that every TTT step computes what serving
computes for a draft chain (same inputs, positions and visible keys). The others make data with
the real default model (4 prompts, 8 new tokens), train a few steps, and load the written head;
the last runs every stage with --device cuda (skipped without a GPU).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from fmserve.cli import main
from fmserve.train_eagle.shards import CapturedData
from fmserve.train_eagle.ttt import collate, ttt_forward
from gpu.eagle.head_io import load_draft_head, random_draft_head
from gpu.model_config import ModelConfig

H, NH, NKV, HD, VOCAB, INTER, LAYERS = 32, 4, 2, 8, 96, 64, 8


def _random_captured(lengths: list[int], prompt_lens: list[int]) -> CapturedData:
    """Two random captured sequences in one shard (ids, aux and final states, argmax)."""
    rows = sum(lengths)
    shard = {"input_ids": torch.randint(0, VOCAB, (rows,), dtype=torch.int32),
             "aux_hidden": torch.randn(rows, 3 * H).half(),
             "final_hidden": torch.randn(rows, H).half(),
             "target_argmax": torch.randint(0, VOCAB, (rows,), dtype=torch.int32)}
    return CapturedData([shard], [0, 0], [0, lengths[0]], [lengths[0], rows], prompt_lens)


def _tiny_target() -> ModelConfig:
    return ModelConfig(architecture="llama", num_layers=LAYERS, hidden_size=H,
                       intermediate_size=INTER, num_heads=NH, num_kv_heads=NKV, head_dim=HD,
                       vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_context_len=256, tie_word_embeddings=True)


def _chain_logits(head, ids, aux, root: int, steps: int) -> list[torch.Tensor]:
    """Draft logits of the chain rooted at ``root``, the way serving runs it: one extend over
    positions 0..root (target state at t, token t+1), then one position per step on top of the
    cached keys, teacher-forced on the true tokens."""
    cache_k, cache_v = [], []

    def attend(q, k, v):
        m = q.shape[0]
        cache_k.append(k)
        cache_v.append(v)
        K, V = torch.cat(cache_k), torch.cat(cache_v)
        g = NH // NKV
        K, V = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q, K) * HD ** -0.5
        past = K.shape[0] - m
        mask = torch.arange(K.shape[0])[None, :] > (past + torch.arange(m))[:, None]
        return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), V)

    out, lh = head(ids[1:root + 2], aux[:root + 1], torch.arange(root + 1), attend)
    hidden, logits = out[-1:], [head.logits(lh[-1:])[0]]
    for k in range(1, steps):
        out, lh = head(ids[root + 1 + k:root + 2 + k], hidden, torch.tensor([root + k]), attend)
        hidden = out
        logits.append(head.logits(lh)[0])
    return logits


def test_ttt_matches_a_serving_chain():
    torch.manual_seed(0)
    target = _tiny_target()
    embed = torch.randn(VOCAB, H) * 0.5
    head = random_draft_head(target, embed, None, draft_vocab_size=48, seed=1)
    with torch.no_grad():
        head.d2t.copy_(torch.arange(48) * 1)  # draft id d -> target id 2d
        head.t2d.zero_()
        head.t2d[torch.arange(48) * 2] = True
    lengths = [14, 10]
    data = _random_captured(lengths, prompt_lens=[5, 3])
    shard = data.shards[0]
    dembed = embed[torch.arange(48) * 2]
    steps = 3
    stats = ttt_forward(head, collate(data, [0, 1]), dembed, steps, keep_logits=True)
    L = max(lengths)
    checked = 0
    for r, flat in enumerate(stats.rows.tolist()):
        b, root = divmod(flat, L)
        start = 0 if b == 0 else lengths[0]
        ids = shard["input_ids"][start:start + lengths[b]].long()
        aux = shard["aux_hidden"][start:start + lengths[b]].float()
        n_steps = min(steps, lengths[b] - 2 - root)
        with torch.no_grad():
            chain = _chain_logits(head, ids, aux, root, n_steps)
        for k in range(n_steps):
            torch.testing.assert_close(stats.row_logits[k][r], chain[k], atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked > 20
    # Loss rows are exactly the chain roots from the last prompt position on.
    assert sorted(stats.rows.tolist()) == [4 + i for i in range(14 - 2 - 4)] + \
        [L + 2 + i for i in range(10 - 2 - 2)]


# -- the real model --------------------------------------------------------------------------

PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a short greeting.",
           "Give one word that rhymes with cat."]


@pytest.fixture(scope="module")
def tiny_run(model_path, tmp_path_factory):
    """Data for 4 prompts (8 new tokens each) and the target's weights, made once."""
    from fmserve.engine import Engine
    from fmserve.train_eagle.data import DataConfig, build_dataset
    from fmserve.train_eagle.head import load_target
    from fmserve.train_eagle.shards import load_dataset
    from gpu.eagle.draft_head import default_aux_layer_ids

    work = tmp_path_factory.mktemp("train_eagle")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    engine = Engine(str(model_path), max_kv_tokens=2048, max_running_requests=4,
                    progress=False)
    layers = engine.worker.state.model_config.num_layers
    capture = tuple(i + 1 for i in default_aux_layer_ids(layers))
    cfg = DataConfig(prompts=str(prompts), num_prompts=4, max_new_tokens=8,
                     sampled_fraction=0.25, shard_size=2)
    build_dataset(engine, cfg, work / "data", capture, "test", progress=False)
    del engine
    return work, load_dataset(work / "data"), load_target(model_path)


def _config(work, **changes):
    from fmserve.train_eagle.trainer import TrainConfig

    fields = dict(data_dir=str(work / "data"), ckpt_dir=str(work / "ckpt"), out=str(work / "head"),
                  draft_vocab_size=512, lr=1e-3, warmup_steps=0, min_lr_ratio=1.0,
                  max_batch_tokens=4096, epochs=100.0, max_steps=6, save_every=100,
                  log_every=100)
    fields.update(changes)
    return TrainConfig(**fields)


def test_data_shards_are_resumable(tiny_run, model_path):
    work, data, _ = tiny_run
    assert len(data) == 4 and len(data.shards) == 2
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 2
    # The hidden states stay on disk until read: each sequence's rows are its slice of the file.
    from safetensors.torch import load_file

    from fmserve.train_eagle.shards import ShardFile
    assert all(isinstance(s, ShardFile) for s in data.shards)
    assert not any(k in s._small for s in data.shards for k in ShardFile.ON_DISK)
    whole = [load_file(str(work / "data" / e["file"])) for e in manifest["shards"]]
    for j in range(len(data)):
        for key in ("aux_hidden", "final_hidden", "input_ids", "target_argmax"):
            assert torch.equal(data.rows(j, key),
                               whole[data.shard[j]][key][data.start[j]:data.end[j]])
    for j in range(len(data)):
        n = data.length(j)
        assert data.rows(j, "aux_hidden").shape == (n, 3 * 576)
        assert data.rows(j, "final_hidden").dtype == torch.float16
        assert n - data.prompt_len[j] >= 2
    # Everything is on disk: a second build does no work (no Engine needed).
    from fmserve.train_eagle.data import DataConfig, build_dataset

    class NoEngine:
        tokenizer = __import__("service.tokenizer", fromlist=["TextTokenizer"]) \
            .TextTokenizer.from_model_path(model_path)

        def generate(self, *a, **k):
            raise AssertionError("a shard on disk was made again")

    cfg = DataConfig(prompts=str(work / "prompts.jsonl"), num_prompts=4, max_new_tokens=8,
                     sampled_fraction=0.25, shard_size=2)
    build_dataset(NoEngine(), cfg, work / "data", tuple(manifest["capture_layers"]), "test",
                  progress=False)


def test_tokens_file_and_packed_recapture_rebuild_the_shards(tiny_run, model_path, tmp_path,
                                                            keep_torch_threads):
    """--stage tokens keeps every sequence's ids; capturing them again in packed prefills
    (several sequences in one forward) gives what one-at-a-time capture gives."""
    from fmserve.engine import Engine
    from fmserve.train_eagle.cli import main
    from fmserve.train_eagle.capture import capture_sequences
    from fmserve.train_eagle.shards import load_dataset
    from fmserve.train_eagle.portable import export_tokens, read_tokens, recapture

    work, data, _ = tiny_run
    tokens = tmp_path / "t.safetensors"
    assert export_tokens([work / "data", work / "data"], tokens) == (8, 2 * data.num_tokens)
    seqs, prompt_lens, sampled, meta = read_tokens(tokens)
    for j in range(4):
        assert seqs[j] == seqs[j + 4] == data.rows(j, "input_ids").tolist()
        assert prompt_lens[j] == data.prompt_len[j]
    assert sum(sampled) == 2 * sum(int(s["sampled"].sum()) for s in data.shards)
    # The CLI stage writes the same sequences (the work dir's own data).
    assert main(["--model", str(model_path), "--work-dir", str(work), "--device", "cpu",
                 "--no-progress", "--stage", "tokens", "--tokens-file",
                 str(tmp_path / "t2.safetensors")]) == 0
    assert read_tokens(tmp_path / "t2.safetensors")[0] == seqs[:4]

    engine = Engine(str(model_path), dtype="fp32", max_kv_tokens=2048, max_running_requests=4,
                    progress=False)
    layers = tuple(json.loads(meta["capture_layers"]))
    longest = max(map(len, seqs))
    recapture(engine.worker.state, tokens, tmp_path / "data", layers, "test", shard_size=3,
              max_batch_tokens=2 * longest + 1, progress=False)  # packs of two
    again = load_dataset(tmp_path / "data")
    assert len(again) == 8 and len(again.shards) == 3
    for j in range(8):
        assert again.rows(j, "input_ids").tolist() == seqs[j]
        assert again.prompt_len[j] == prompt_lens[j]
        alone = capture_sequences(engine.worker.state, [seqs[j]], layers)  # one sequence a prefill
        aux, final, argmax = alone["aux_hidden"], alone["final_hidden"], alone["target_argmax"]
        torch.testing.assert_close(again.rows(j, "aux_hidden").float(), aux.float(),
                                   rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(again.rows(j, "final_hidden").float(), final.float(),
                                   rtol=2e-3, atol=2e-3)
        assert torch.equal(again.rows(j, "target_argmax"), argmax)
    # Packs also stop at what the KV pool holds: a pool of two longest sequences, no token cap.
    small = Engine(str(model_path), dtype="fp32", max_kv_tokens=2 * longest,
                   max_running_requests=4, progress=False)
    rows = capture_sequences(small.worker.state, seqs, layers, max_batch_tokens=1 << 20)
    assert rows["offsets"].tolist() == [0] + list(itertools.accumulate(map(len, seqs)))
    for key in ("aux_hidden", "final_hidden"):
        torch.testing.assert_close(rows[key].float(), torch.cat(
            [again.rows(j, key) for j in range(8)]).float(), rtol=2e-3, atol=2e-3)
    del small
    # The CLI's data stage with --tokens-file captures instead of generating.
    assert main(["--model", str(model_path), "--work-dir", str(tmp_path / "cli"), "--device",
                 "cpu", "--dtype", "fp32", "--no-progress", "--stage", "data", "--shard-size",
                 "5", "--tokens-file", str(tokens)]) == 0
    from_cli = load_dataset(tmp_path / "cli" / "data")
    assert len(from_cli) == 8 and len(from_cli.shards) == 2
    assert [from_cli.rows(j, "input_ids").tolist() for j in range(8)] == seqs
    with pytest.raises(SystemExit, match="not a tokens file"):
        read_tokens(work / "data" / "shard-00000.safetensors")
    with pytest.raises(SystemExit, match="captured at layers"):
        recapture(engine.worker.state, tokens, tmp_path / "other", (1, 2, 3), "test", progress=False)


def test_training_lowers_the_loss_and_writes_a_loadable_head(tiny_run, model_path):
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    result = train(_config(work, ckpt_dir=str(work / "ckpt-a"), out=str(work / "head-a")),
                   model_path, progress=False, data=data, target=target)
    losses = [loss for _, loss, _ in result.history]
    assert len(losses) == 6
    assert losses[-1] < losses[0] * 0.9, losses
    model_cfg, embed, _, _ = target
    head = load_draft_head(work / "head-a", model_cfg, embed, None, "cpu", torch.float32)
    assert head.config.draft_vocab_size == 512
    assert head.config.capture_layers == tuple(json.loads(
        (work / "data" / "manifest.json").read_text())["capture_layers"])
    weights = work / "head-a" / "model.safetensors"
    assert weights.stat().st_size < 25e6
    record = json.loads((work / "head-a" / "training.json").read_text())
    assert record["step"] == 6 and len(record["train_acc_per_position"]) == 4


def test_bf16_autocast_on_the_cpu_trains_like_fp32(tiny_run, model_path):
    """--precision bf16 on a CPU: the same first loss as fp32 (same init, same batch) to bf16's
    precision, the loss still falls, and the record says which arithmetic ran."""
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    runs = {p: train(_config(work, ckpt_dir=str(work / f"ckpt-{p}"), out=str(work / f"head-{p}"),
                             precision=p), model_path, progress=False, data=data, target=target)
            for p in ("fp32", "bf16")}
    fp32, bf16 = ([loss for _, loss, _ in runs[p].history] for p in ("fp32", "bf16"))
    assert bf16[0] == pytest.approx(fp32[0], rel=0.03)
    assert bf16[0] != fp32[0]  # it did run in bf16
    assert bf16[-1] < bf16[0] * 0.9, bf16
    records = {p: json.loads((work / f"head-{p}" / "training.json").read_text()) for p in runs}
    assert records["fp32"]["precision"] == "fp32"
    assert records["bf16"]["precision"] == "bf16 autocast, fp32 master weights"


def test_resume_without_a_checkpoint_says_it_starts_from_scratch(tiny_run, model_path, capsys):
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    run = train(_config(work, ckpt_dir=str(work / "ckpt-none"), out=str(work / "head-none"),
                        max_steps=1, resume=True), model_path, progress=False, data=data,
                target=target)
    assert run.steps == 1
    assert "holds no checkpoint: starting from scratch" in capsys.readouterr().err


def test_resume_continues_where_it_stopped(tiny_run, model_path):
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    straight = train(_config(work, ckpt_dir=str(work / "ckpt-s"), out=str(work / "head-s"),
                             max_steps=4), model_path, progress=False, data=data, target=target)
    first = train(_config(work, ckpt_dir=str(work / "ckpt-r"), out=str(work / "head-r"),
                          max_steps=2, save_every=1), model_path, progress=False, data=data,
                  target=target)
    assert first.steps == 2
    with pytest.raises(SystemExit, match="--resume"):
        train(_config(work, ckpt_dir=str(work / "ckpt-r"), out=str(work / "head-r"),
                      max_steps=4), model_path, progress=False, data=data, target=target)
    resumed = train(_config(work, ckpt_dir=str(work / "ckpt-r"), out=str(work / "head-r"),
                            max_steps=4, resume=True), model_path, progress=False, data=data,
                    target=target)
    assert [s for s, _, _ in resumed.history] == [3, 4]
    assert sorted(p.name for p in (work / "ckpt-r").glob("*.pt"))[-1] == "step-0000004.pt"
    for (_, a, _), (_, b, _) in zip(straight.history[2:], resumed.history):
        assert a == pytest.approx(b, rel=1e-4)
    model_cfg, embed, _, _ = target
    heads = [load_draft_head(work / d, model_cfg, embed, None, "cpu", torch.float32)
             for d in ("head-s", "head-r")]
    for (name, a), b in zip(heads[0].state_dict().items(), heads[1].state_dict().values()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=name)


def test_init_head_starts_from_a_trained_head(tiny_run, model_path):
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    first = train(_config(work, ckpt_dir=str(work / "ckpt-i0"), out=str(work / "head-i0"),
                          ship_dtype="fp32"), model_path, progress=False, data=data, target=target)
    # lr 0: the one step changes nothing, so the head it writes is the one it started from
    again = train(_config(work, ckpt_dir=str(work / "ckpt-i1"), out=str(work / "head-i1"),
                          init_head=str(work / "head-i0"), lr=0.0, max_steps=1),
                  model_path, progress=False, data=data, target=target)
    assert again.history[0][1] < first.history[0][1] * 0.9  # it starts where the first ended
    model_cfg, embed, _, _ = target
    heads = [load_draft_head(work / d, model_cfg, embed, None, "cpu", torch.float32)
             for d in ("head-i0", "head-i1")]
    for (name, a), b in zip(heads[0].state_dict().items(), heads[1].state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=name)  # d2t included
    record = json.loads((work / "head-i1" / "training.json").read_text())
    assert record["init_head"] == str(work / "head-i0")
    with pytest.raises(SystemExit, match="draft_vocab_size=512, this run 256"):
        train(_config(work, ckpt_dir=str(work / "ckpt-i2"), out=str(work / "head-i2"),
                      init_head=str(work / "head-i0"), draft_vocab_size=256),
              model_path, progress=False, data=data, target=target)


def test_a_wider_head_trains_ships_and_is_kept_by_fine_tuning(tiny_run, model_path):
    """--head-intermediate-size: the head's MLP is that wide, it trains and ships in the
    public layout (config.json says the width), a fine-tune from it keeps the width without
    being told, and a resume with another width is refused."""
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    model_cfg, embed, _, _ = target
    wide = 2 * model_cfg.intermediate_size
    result = train(_config(work, ckpt_dir=str(work / "ckpt-w"), out=str(work / "head-w"),
                           head_intermediate_size=wide, save_every=1, max_steps=3),
                   model_path, progress=False, data=data, target=target)
    losses = [loss for _, loss, _ in result.history]
    assert losses[-1] < losses[0], losses
    head = load_draft_head(work / "head-w", model_cfg, embed, None, "cpu", torch.float32)
    assert head.config.intermediate_size == wide
    assert tuple(head.midlayer.mlp.down_proj.weight.shape) == (model_cfg.hidden_size, wide)
    assert json.loads((work / "head-w" / "training.json").read_text())[
        "head_intermediate_size"] == wide
    train(_config(work, ckpt_dir=str(work / "ckpt-w2"), out=str(work / "head-w2"),
                  init_head=str(work / "head-w"), lr=0.0, max_steps=1),
          model_path, progress=False, data=data, target=target)
    again = load_draft_head(work / "head-w2", model_cfg, embed, None, "cpu", torch.float32)
    assert again.config.intermediate_size == wide
    with pytest.raises(SystemExit, match="head_intermediate_size"):
        train(_config(work, ckpt_dir=str(work / "ckpt-w"), out=str(work / "head-w"),
                      max_steps=4, resume=True), model_path, progress=False, data=data,
              target=target)


def test_the_widest_head_the_help_names_fits_in_25_mb(tmp_path, model_path):
    """The default model's head at 2944 wide with 8,192 draft tokens, in fp16, stays under the
    25 MB the repository allows a shipped head (--head-intermediate-size's help says so)."""
    from fmserve.train_eagle.head import load_target
    from gpu.eagle.head_io import random_draft_head, save_draft_head

    model_cfg, embed, _, _ = load_target(model_path)
    head = random_draft_head(model_cfg, embed, None, "eagle3", draft_vocab_size=8192,
                             intermediate_size=2944)
    save_draft_head(head, tmp_path, dtype=torch.float16)
    assert 24e6 < (tmp_path / "model.safetensors").stat().st_size < 25e6


def test_remap_lm_head_keeps_shared_rows_and_maps_new_ones_through_the_embedding():
    from types import SimpleNamespace

    from fmserve.train_eagle.head import remap_lm_head

    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(256, 8, generator=gen)
    linear = torch.randn(8, 8, generator=gen)

    def fake_head(target_ids, rows=None):
        ids = torch.tensor(target_ids)
        return SimpleNamespace(config=SimpleNamespace(draft_vocab_size=len(ids)),
                               d2t=ids - torch.arange(len(ids)),
                               lm_head=SimpleNamespace(weight=rows))

    src_ids = list(range(0, 256, 2))  # even ids
    rows = embed[src_ids] @ linear  # trained rows that are exactly linear in the embedding...
    rows[0] += 1.0  # ...but for token 0, whose row must still be kept as trained
    src = fake_head(src_ids, rows)
    new_ids = [0, 1, 2, 3, 5, 7, 9, 11]
    out = remap_lm_head(src, fake_head(new_ids), embed)
    assert out.shape == (8, 8)
    torch.testing.assert_close(out[[0, 2]], rows[[0, 1]])  # tokens 0 and 2: their rows as trained
    fit = embed[[1, 3, 5, 7, 9, 11]] @ linear  # new odd tokens: the map recovered from the rows
    torch.testing.assert_close(out[[1, 3, 4, 5, 6, 7]], fit, atol=0.15, rtol=0.05)


def test_refresh_vocab_counts_this_runs_vocabulary_and_keeps_the_trained_layers(tiny_run,
                                                                               model_path):
    from fmserve.train_eagle.shards import response_token_counts
    from fmserve.train_eagle.trainer import train
    from gpu.eagle.vocab_map import build_vocab_map

    work, data, target = tiny_run
    train(_config(work, ckpt_dir=str(work / "ckpt-v0"), out=str(work / "head-v0"),
                  ship_dtype="fp32"), model_path, progress=False, data=data, target=target)
    train(_config(work, ckpt_dir=str(work / "ckpt-v1"), out=str(work / "head-v1"),
                  ship_dtype="fp32", init_head=str(work / "head-v0"), refresh_vocab=True,
                  draft_vocab_size=1024, lr=0.0, max_steps=1),
          model_path, progress=False, data=data, target=target)
    model_cfg, embed, _, _ = target
    old, new = (load_draft_head(work / d, model_cfg, embed, None, "cpu", torch.float32)
                for d in ("head-v0", "head-v1"))
    assert new.config.draft_vocab_size == 1024
    d2t, _ = build_vocab_map(response_token_counts(data, model_cfg.vocab_size), 1024)
    torch.testing.assert_close(new.d2t.cpu(), d2t)  # the vocabulary counted on this run's data
    for (name, a), b in zip(old.state_dict().items(), new.state_dict().values()):
        if name not in ("lm_head.weight", "d2t", "t2d"):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    old_ids = (torch.arange(512) + old.d2t.cpu()).tolist()
    new_ids = (torch.arange(1024) + new.d2t.cpu()).tolist()
    row = {t: i for i, t in enumerate(old_ids)}
    shared = [(row[t], i) for i, t in enumerate(new_ids) if t in row]
    assert len(shared) == 512  # a superset of the old vocabulary here
    torch.testing.assert_close(new.lm_head.weight[[i for _, i in shared]],
                               old.lm_head.weight[[j for j, _ in shared]])
    assert json.loads((work / "head-v1" / "training.json").read_text())["refresh_vocab"]
    with pytest.raises(SystemExit, match="give --init-head too"):
        train(_config(work, ckpt_dir=str(work / "ckpt-v2"), refresh_vocab=True), model_path,
              progress=False, data=data, target=target)


def test_extra_data_is_trained_on_and_the_held_out_tail_is_the_work_dirs(tiny_run, model_path,
                                                                          tmp_path):
    import shutil

    from fmserve.train_eagle.shards import load_datasets
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    other = tmp_path / "other-data"
    shutil.copytree(work / "data", other)
    both = load_datasets([other, work / "data"])
    assert len(both) == 2 * len(data) and len(both.shards) == 2 * len(data.shards)
    for j in range(len(data)):  # the work dir's own sequences come last, unchanged
        k = len(data) + j
        assert torch.equal(both.rows(k, "input_ids"), data.rows(j, "input_ids"))
        assert both.prompt_len[k] == data.prompt_len[j]
    assert len(load_datasets([other, work / "data"], max_sequences=3)) == 3
    result = train(_config(work, ckpt_dir=str(tmp_path / "ckpt"), out=str(tmp_path / "head"),
                           extra_data=(str(other),), val_sequences=2, max_steps=2),
                   model_path, progress=False, target=target)
    assert result.steps == 2
    record = json.loads((tmp_path / "head" / "training.json").read_text())
    assert record["sequences"] == 8 and record["val_sequences"] == 1  # at most a fifth
    assert record["extra_data"] == [str(other)]
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["capture_layers"] = [1, 2, 3]
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="mix only data of one model"):
        load_datasets([other, work / "data"])


def test_prompt_rows_train_but_do_not_count():
    torch.manual_seed(0)
    target = _tiny_target()
    embed = torch.randn(VOCAB, H) * 0.5
    head = random_draft_head(target, embed, None, draft_vocab_size=VOCAB, seed=1)
    data = _random_captured([12, 9], prompt_lens=[6, 4])
    batch = collate(data, [0, 1])
    only = ttt_forward(head, batch, embed, 3)
    both = ttt_forward(head, batch, embed, 3, prompt_weight=0.5)
    assert only.counts == both.counts  # accuracy counts response-rooted chains only
    assert only.correct == both.correct
    assert float(both.loss.detach()) != pytest.approx(float(only.loss.detach()))
    for a, b in zip(only.row_valid, both.row_valid):
        assert int(a.sum()) == int(b.sum())


def test_time_budget_sets_the_number_of_steps(tiny_run, model_path):
    from fmserve.train_eagle.trainer import train

    work, data, target = tiny_run
    result = train(_config(work, ckpt_dir=str(work / "ckpt-t"), out=str(work / "head-t"),
                           max_steps=500, max_minutes=0.08), model_path, progress=False,
                   data=data, target=target)
    assert 8 < result.steps < 500
    record = json.loads((work / "head-t" / "training.json").read_text())
    assert record["step"] == record["total_steps"] == result.steps


# -- devices ---------------------------------------------------------------------------------

def _cli(model_path, work, prompts, device, *extra) -> list[str]:
    """`fmserve train-eagle` arguments for a tiny run in ``work`` (4 prompts, 8 new tokens)."""
    return ["--model", str(model_path), "--work-dir", str(work), "--out", str(work / "head"),
            "--device", device, "--no-progress", "--prompts", str(prompts), "--num-prompts", "4",
            "--max-new-tokens", "8", "--shard-size", "2", "--draft-vocab-size", "512",
            "--no-vocab-prior", "--warmup-steps", "0", "--min-lr-ratio", "1.0",
            "--max-batch-tokens", "4096", "--save-every", "100", "--log-every", "100", *extra]


@pytest.fixture
def keep_torch_threads():
    """The CLI sets torch's thread count (its ThreadGovernor): put it back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_shard_groups_and_engine_sizes():
    from fmserve.train_eagle.cli import add_arguments
    from fmserve.train_eagle.stages import gen_engine_sizes
    from fmserve.train_eagle.data import shard_groups

    assert shard_groups([0, 1, 2, 3], [200] * 4, None) == [[0], [1], [2], [3]]
    assert shard_groups([0, 1, 2, 3], [200] * 4, 256) == [[0], [1], [2], [3]]
    assert shard_groups([0, 1, 2, 4, 5], [100] * 5 + [50], 256) == [[0, 1], [2], [4, 5]]
    assert shard_groups([3], [2, 2, 2, 1], 1) == [[3]]  # a shard larger than the batch: alone
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert args.device == "auto" and args.gen_batch_size is None
    args.device = "cpu"
    assert gen_engine_sizes(args) == (64, 65536)  # the Engine's defaults, as before
    args.device = "cuda"
    batch, kv = gen_engine_sizes(args)
    assert batch == 256 and kv >= 256 * (384 + 192)
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])
    from fmserve.train_eagle.trainer import TrainConfig

    args = p.parse_args(["--extra-data", "a/data", "--extra-data", "b/data"])
    cfg = TrainConfig.from_args(args, Path("w"), Path("out"))
    assert cfg.extra_data == ("a/data", "b/data") and cfg.data_dir == str(Path("w") / "data")
    assert TrainConfig.from_args(p.parse_args([]), Path("w"), Path("out")).extra_data == ()
    assert TrainConfig.from_args(p.parse_args([]), Path("w"), Path("out")).decay == 0.8
    args = p.parse_args(["--step-loss-decay", "1.0"])
    assert TrainConfig.from_args(args, Path("w"), Path("out")).decay == 1.0
    from fmserve.train_eagle.cli import run
    with pytest.raises(SystemExit, match="--step-loss-decay must be in"):
        run(p.parse_args(["--step-loss-decay", "0"]))
    with pytest.raises(SystemExit, match="--shard-size must be >= 1"):
        run(p.parse_args(["--shard-size", "0"]))


def test_cli_device_cpu_is_accepted_and_recorded(model_path, tmp_path, keep_torch_threads):
    from fmserve.train_eagle.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA"):
            main(_cli(model_path, tmp_path, prompts, "cuda", "--stage", "train"))
    # Data: two shards of 2 prompts, generated in one Engine run (--gen-batch-size 4).
    assert main(_cli(model_path, tmp_path, prompts, "cpu", "--stage", "data",
                     "--gen-batch-size", "4")) == 0
    from safetensors import safe_open

    from fmserve.train_eagle.shards import load_dataset
    assert len(load_dataset(tmp_path / "data")) == 4
    for shard in sorted((tmp_path / "data").glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            assert f.metadata()["device"] == "cpu"
    assert main(_cli(model_path, tmp_path, prompts, "cpu", "--stage", "train",
                     "--max-steps", "2")) == 0
    record = json.loads((tmp_path / "head" / "training.json").read_text())
    assert record["device"] == "cpu" and "gpu" not in record and record["step"] == 2
    assert record["precision"] == "fp32"
    ckpt = torch.load(sorted((tmp_path / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    assert ckpt["config"]["device"] == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_end_to_end(model_path, tmp_path, keep_torch_threads):
    """Every stage with --device cuda: data made on the GPU (fp16 CPU shards), training under
    bf16 autocast (the loss drops; its first step agrees with the CPU's), CPU checkpoints that
    resume on the CPU, a head that loads anywhere, and both evaluations on the GPU."""
    from fmserve.train_eagle.cli import main
    from fmserve.train_eagle.shards import load_dataset
    from fmserve.train_eagle.head import load_target
    from fmserve.train_eagle.trainer import train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(_cli(model_path, tmp_path, prompts, "cuda", "--stage", "data",
                     "--gen-batch-size", "4")) == 0
    data = load_dataset(tmp_path / "data")
    assert len(data) == 4
    for shard in data.shards:
        assert shard["aux_hidden"].dtype == torch.float16
        assert shard["aux_hidden"].device.type == "cpu"
        assert torch.isfinite(shard["aux_hidden"].float()).all()
    target = load_target(model_path)

    result = train(_config(tmp_path, device="cuda"), model_path, progress=False, data=data,
                   target=target)
    losses = [loss for _, loss, _ in result.history]
    assert len(losses) == 6
    assert losses[-1] < losses[0] * 0.9, losses
    # The same first batch and the same init on the CPU (fp32): bf16 autocast stays close.
    cpu = train(_config(tmp_path, ckpt_dir=str(tmp_path / "ckpt-cpu"),
                        out=str(tmp_path / "head-cpu"), max_steps=1), model_path,
                progress=False, data=data, target=target)
    assert losses[0] == pytest.approx(cpu.history[0][1], rel=0.03)

    record = json.loads((tmp_path / "head" / "training.json").read_text())
    assert record["device"] == "cuda" and record["gpu"] == torch.cuda.get_device_name(0)
    assert record["step"] == 6
    model_cfg, embed, _, _ = target
    for dev in ("cpu", "cuda"):
        head = load_draft_head(tmp_path / "head", model_cfg, embed, None, dev, torch.float32)
        assert head.config.draft_vocab_size == 512
    from safetensors import safe_open
    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16

    # The checkpoint holds CPU tensors only, and the run resumes on the CPU.
    ckpt_path = sorted((tmp_path / "ckpt").glob("*.pt"))[-1]
    state = torch.load(ckpt_path, weights_only=False)  # no map_location: CPU as saved

    def devices(obj):
        if isinstance(obj, torch.Tensor):
            yield obj.device.type
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from devices(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from devices(v)

    assert set(devices(state["head"])) | set(devices(state["optimizer"])) == {"cpu"}
    resumed = train(_config(tmp_path, max_steps=8, resume=True), model_path, progress=False,
                    data=data, target=target)
    assert [s for s, _, _ in resumed.history] == [7, 8]
    assert json.loads((tmp_path / "head" / "training.json").read_text())["device"] == "cpu"

    # Both evaluations on the GPU (the estimate's data made there too).
    assert main(_cli(model_path, tmp_path, prompts, "cuda", "--stage", "eval",
                     "--eval-mode", "both", "--eval-prompts", str(prompts),
                     "--eval-num-prompts", "4", "--eval-max-new-tokens", "16",
                     "--num-steps", "3")) == 0
    assert (tmp_path / "eval-data" / "manifest.json").exists()


def test_spec_eval_measures_a_chain_and_a_tree_with_the_shipped_head(tmp_path, model_path,
                                                                      keep_torch_threads, capsys):
    """`--stage eval` on the real speculative path, by default a chain and a tree: the figures
    it logs add up (accept length = 1 + the per-position shares), and the tree reaches the
    engine (the shipped head gets more accepted from it than from the chain)."""
    from fmserve.default_model import SHIPPED_EAGLE3_HEAD, is_default_model
    from fmserve.train_eagle.cli import main

    if not is_default_model(model_path):
        pytest.skip("the shipped head belongs to the default model")
    prompts = tmp_path / "dev.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    assert main(["--model", str(model_path), "--work-dir", str(tmp_path), "--device", "cpu",
                 "--no-progress", "--out", str(SHIPPED_EAGLE3_HEAD), "--stage", "eval",
                 "--eval-prompts", str(prompts), "--eval-num-prompts", "2",
                 "--eval-max-new-tokens", "24", "--num-steps", "3", "--dtype", "fp32"]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if "speculative decoding" in l]
    assert len(lines) == 2
    assert "chain of 3" in lines[0] and "tree of 8 tokens (3 steps, topk 4)" in lines[1], lines
    figures = []
    for line in lines:
        m = re.search(r"mean accept length ([\d.]+) over (\d+) verify steps; accepted by draft "
                      r"position ([\d. ]+);", line)
        assert m, line
        length, shares = float(m.group(1)), [float(x) for x in m.group(3).split()]
        assert len(shares) == 3 and shares == sorted(shares, reverse=True)
        assert length == pytest.approx(1 + sum(shares), abs=2e-3)
        figures.append(length)
    chain, tree = figures
    assert chain > 1.2  # a trained head gets drafts accepted (1.8 here)
    assert tree > chain  # 2.53 here


@pytest.mark.parametrize("extra, message", [
    (["--eval-shapes", "star"], "give chain, tree or chain,tree"),
    (["--eval-topk", "1"], "a tree needs 2 or more children"),
    (["--eval-draft-tokens", "40"], "the eval setting .* is not one the engine can run"),
])
def test_bad_eval_shapes_are_refused_before_any_work(tmp_path, extra, message):
    from fmserve.train_eagle.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["--work-dir", str(tmp_path), "--stage", "eval", "--num-steps", "3", *extra])


def test_bad_numbers_and_prompt_files_are_refused_with_their_name(tmp_path, capsys):
    from fmserve.train_eagle.cli import main
    from fmserve.train_eagle.data import read_prompts

    # --save-every 0 and --log-every 0 ended training in a ZeroDivisionError after its first
    # step; --max-steps 0 shipped an untrained head.
    for flag in ("--save-every", "--log-every", "--max-steps", "--num-prompts", "--eval-batch"):
        with pytest.raises(SystemExit) as info:
            main(["--work-dir", str(tmp_path), "--stage", "train", flag, "0"])
        assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    # A bad --init-head was found only when training started: with --stage all, after the data.
    with pytest.raises(SystemExit, match="--init-head: draft head directory .*nowhere has no "
                                         "config.json"):
        main(["--work-dir", str(tmp_path), "--init-head", str(tmp_path / "nowhere")])
    # A line that is not JSON was reported as json's own message, naming neither file nor line.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: not valid JSON"):
        read_prompts(prompts)
    # One nested past Python's recursion limit ended in a bare RecursionError.
    prompts.write_text('{"prompt": "one"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: JSON nested too deeply"):
        read_prompts(prompts)
    prompts.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl: not UTF-8 text"):
        read_prompts(prompts)


# ----- --out and prompt files refused before any stage runs -----
# `fmserve train-eagle`: an --out that cannot hold the head, and prompt files with nothing to
# use, are refused before any stage runs (and leave no data behind).
#
# - --out naming an existing file was found when training wrote its first checkpoint's head (50
#   steps in by default; with --stage all after the whole data stage), as a bare
#   "[Errno 17] File exists".
# - A --prompts file with no rows (or none that fit --max-prompt-tokens) made a "complete" data
#   set of 0 shards and exit 0; that empty set then locked the work dir (a later run with a good
#   file was refused as "data made with another selection") and training said only "no complete
#   shard yet". An empty --eval-prompts file gave an evaluation of 0 prompts, exit 0.

def _run(tmp_path, *flags) -> int:
    return main(["train-eagle", "--work-dir", str(tmp_path / "work"), "--no-progress",
                 "--device", "cpu", *flags])


def test_out_that_is_a_file_is_refused_before_any_stage(tmp_path, tiny_llama, capsys):
    out = tmp_path / "head"
    out.write_text("not a directory")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w3 w4"}\n')
    for stage in ("all", "train", "eval"):
        rc = _run(tmp_path, "--model", str(tiny_llama), "--stage", stage, "--out", str(out),
                  "--prompts", str(prompts), "--eval-prompts", str(prompts))
        err = capsys.readouterr().err
        assert rc == 2 and f"--out {out} is a file" in err, (stage, err)
        assert not (tmp_path / "work" / "data").exists()
    inside = out / "sub"  # its parent a file: mkdir fails the same way
    assert _run(tmp_path, "--model", str(tiny_llama), "--stage", "train",
                "--out", str(inside)) == 2
    assert f"--out {inside}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_prompt_files_are_refused_before_the_model_loads(tmp_path, capsys, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    model = str(tmp_path / "no-model.gguf")  # never reached: the file is checked first
    assert _run(tmp_path, "--model", model, "--stage", "data", "--prompts", str(empty)) == 2
    assert f"--prompts: {empty}: no prompts" in capsys.readouterr().err
    assert _run(tmp_path, "--model", model, "--stage", "eval", "--eval-prompts", str(empty)) == 2
    assert f"--eval-prompts: {empty}: no prompts" in capsys.readouterr().err
    # --stage all evaluates after hours of data and training: its eval file is checked first.
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "w3"}\n')
    assert _run(tmp_path, "--model", model, "--prompts", str(good),
                "--eval-prompts", str(empty)) == 2
    assert f"--eval-prompts: {empty}: no prompts" in capsys.readouterr().err
    assert _run(tmp_path, "--model", model, "--stage", "data",
                "--prompts", str(tmp_path / "missing.jsonl")) == 2
    assert "--prompts: " in capsys.readouterr().err


def test_prompts_that_all_exceed_max_prompt_tokens_make_no_data(tmp_path, tiny_llama, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "' + " ".join(["w5"] * 40) + '"}\n')
    assert _run(tmp_path, "--model", str(tiny_llama), "--stage", "data", "--dtype", "fp32",
                "--prompts", str(long), "--max-prompt-tokens", "8") == 2
    err = capsys.readouterr().err
    assert "none of the 1 prompts" in err and "--max-prompt-tokens 8" in err, err
    assert not (tmp_path / "work" / "data" / "manifest.json").exists()
