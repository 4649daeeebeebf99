"""DFlash training on a tiny random target: the block mask isolates blocks, the training forward equals the
inference forward, the split, SDPA and flex attention variants agree, the loss weights, one step lowers the
loss, a checkpoint resumes to the same state, and the real-worker dev evaluation runs on a trained checkpoint;
DFlash 2 (parametrised where the same holds): the selector's candidates and teacher-forced picks, and the exact
warm start from a DFlash 1 checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dflash_helpers import save_tiny_target, tiny_target_config

from sglang_dflash.models.dflash import block_input_ids, random_draft_model
from sglang_dflash.models.dflash2 import DFlash2Config
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.training.block_attention import draft_blocks_forward
from sglang_dflash.training.data import is_dev_record
from sglang_dflash.training.datagen import write_shard
from sglang_dflash.training.feature_cache import FeatureCache
from sglang_dflash.training.loss import (
    block_labels,
    position_weights,
    selector_candidates,
    soft_block_targets,
    weighted_block_loss,
    weighted_soft_block_loss,
)
from sglang_dflash.training.trainer import BUDGET_PROBE_STEPS, DFlashTrainer, TrainConfig, lr_at

ROOT = Path(__file__).resolve().parent.parent
VOCAB, BLOCK, MASK = 48, 4, 5
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=4)
ARCHITECTURES = pytest.mark.parametrize("arch", [{}, DFLASH2], ids=["dflash", "dflash2"])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / "target", tiny_target_config(VOCAB, layers=8), seed=3)


def tiny_draft(seed: int = 0):
    cfg = DFlashConfig.for_target(tiny_target_config(VOCAB, layers=8), 2, BLOCK, MASK)
    cfg.target_layer_ids = [1, 5]
    model = random_draft_model(cfg, seed=seed, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    model.bind_target(torch.nn.Embedding.from_pretrained(torch.randn(VOCAB, 32, generator=g)),
                      torch.nn.Linear(32, VOCAB, bias=False))
    model.prepare_inference(torch.device("cpu"))
    return model


def records(n: int, seed: int, prefix: str = "r") -> list[dict]:
    """Prompt of 6 random tokens, then a response that cycles through a short random pattern."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pattern = torch.randint(6, VOCAB - 1, (5,), generator=g).tolist()
        out.append({"id": f"{prefix}{i}", "source": "test", "prompt_ids": torch.randint(6, VOCAB - 1, (6,),
                    generator=g).tolist(), "response_ids": (pattern * 5)[:22], "finish": "length",
                    "sampling": {"temperature": 0.0}})
    return out


def train_config(out: Path, target: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(out), model_path=str(target), num_layers=2, num_target_layers_used=2, block_size=BLOCK,
                mask_token_id=MASK, anchors_per_seq=8, max_len=64, seqs_per_step=2, total_steps=6, lr=3e-3,
                draft_vocab_size=None, ckpt_every=3, eval_every=100, eval_worker_prompts=0, autocast_bf16=False)
    base.update(kw)
    return TrainConfig(**base)


def test_block_sees_only_its_context_and_itself():
    torch.manual_seed(0)
    draft = tiny_draft()
    seq_len = 30
    feats = torch.randn(seq_len, 2 * 32)
    ids = torch.randint(6, VOCAB, (seq_len,))
    anchors = torch.tensor([4, 9, 17, 25])
    base = draft_blocks_forward(draft, feats, ids, anchors, BLOCK).view(4, BLOCK, -1)
    j = 1  # perturb everything block 1 must not see: context at positions >= its anchor, other blocks' tokens
    feats2, ids2 = feats.clone(), ids.clone()
    feats2[anchors[j]:] = torch.randn(seq_len - anchors[j], 2 * 32)
    others = torch.tensor([a for i, a in enumerate(anchors.tolist()) if i != j])
    ids2[others] = (ids2[others] + 7) % VOCAB
    after = draft_blocks_forward(draft, feats2, ids2, anchors, BLOCK).view(4, BLOCK, -1)
    torch.testing.assert_close(after[j], base[j], rtol=0, atol=1e-6)
    assert (after[j + 1] - base[j + 1]).abs().max() > 1e-3  # later blocks do see that context
    feats3 = feats.clone()
    feats3[anchors[j] - 1] += 1.0  # the last visible context position matters to block j
    seen = draft_blocks_forward(draft, feats3, ids, anchors, BLOCK).view(4, BLOCK, -1)
    assert (seen[j] - base[j]).abs().max() > 1e-3
    assert (seen[j - 1] - base[j - 1]).abs().max() == 0  # ... and not to the block anchored before it


def test_training_forward_equals_the_inference_forward():
    """The same layers with the other attention: anchor blocks over the sequence's features equal the
    inference forward over the paged cache, with context K/V materialised at slot = position + 1."""
    torch.manual_seed(3)
    draft = tiny_draft(seed=4)
    seq_len, anchors = 30, torch.tensor([4, 9, 17, 28])
    feats, ids = torch.randn(seq_len, 2 * 32), torch.randint(0, VOCAB, (seq_len,))
    cfg, m = draft.config, len(anchors)
    k_buffer = torch.zeros(cfg.num_hidden_layers, 1 + seq_len + m * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    v_buffer = torch.zeros_like(k_buffer)
    block_slots = 1 + seq_len + torch.arange(m * BLOCK).view(m, BLOCK)
    kv_indices = torch.zeros(m, int(anchors.max()) + BLOCK, dtype=torch.int64)
    for j, a in enumerate(anchors.tolist()):
        kv_indices[j, : a + BLOCK] = torch.cat([torch.arange(1, a + 1), block_slots[j]])
    positions = anchors[:, None] + torch.arange(BLOCK)
    with torch.inference_mode():
        draft.materialize_context_kv(feats, torch.arange(seq_len), torch.arange(1, seq_len + 1), k_buffer, v_buffer)
        inference = draft(block_input_ids(ids[anchors], BLOCK, MASK).flatten(), positions.flatten(),
                          block_slots.flatten(), kv_indices, anchors + BLOCK, BLOCK, k_buffer, v_buffer)
        training = draft_blocks_forward(draft, feats, ids, anchors, BLOCK)
    torch.testing.assert_close(training, inference, rtol=0, atol=1e-4)


def test_attention_variants_match_the_dense_sdpa_reference():
    """'split' (the trainer's default) and 'flex' equal SDPA with the dense boolean mask; split's
    gradients too (flex has no backward on CPU in torch 2.13, so the trainer refuses it there)."""
    torch.manual_seed(1)
    draft = tiny_draft(seed=2)
    for seq_len, anchors in ((40, [3, 11, 12, 30, 38]), (17, [0, 16]), (64, None)):
        feats, ids = torch.randn(seq_len, 64), torch.randint(0, VOCAB, (seq_len,))
        a = torch.tensor(anchors) if anchors else torch.randperm(seq_len)[:9].sort().values
        with torch.no_grad():
            ref = draft_blocks_forward(draft, feats, ids, a, BLOCK, "sdpa")
            flex = draft_blocks_forward(draft, feats, ids, a, BLOCK, "flex")
        torch.testing.assert_close(flex, ref, rtol=1e-4, atol=1e-5)
        grads = []
        for variant in ("sdpa", "split"):
            draft.zero_grad()
            out = draft_blocks_forward(draft, feats, ids, a, BLOCK, variant)
            out.square().mean().backward()
            grads.append([p.grad.clone() for p in draft.parameters() if p.grad is not None])
            if variant == "split":
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        for g_ref, g_split in zip(*grads):
            torch.testing.assert_close(g_split, g_ref, rtol=1e-4, atol=1e-5)
        assert len(grads[1]) == len(grads[0]) > 0
    with pytest.raises(ValueError, match="attention must be"):
        draft_blocks_forward(draft, feats, ids, a, BLOCK, "dense")


def test_loss_weights_and_weighted_loss():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    for k in range(1, 16):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    ids = torch.arange(10, 30)
    anchors = torch.tensor([2, 17])
    labels = block_labels(ids, anchors, 4)
    assert labels.tolist() == [[13, 14, 15], [28, 29, -100]]
    logits = torch.randn(2, 3, 40)
    ws = torch.tensor([1.0, 0.5, 0.25])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none")
    mask = (labels >= 0).flatten().float()
    expect = (ce * ws.repeat(2) * mask).sum() / (ws.repeat(2) * mask).sum()
    torch.testing.assert_close(weighted_block_loss(logits, labels, ws), expect)


def fixed_batch_loss(trainer: DFlashTrainer, recs: list[dict]) -> float:
    from sglang_dflash.training.features import target_features

    seqs = [trainer.data.sequence(r) for r in recs]
    feats = target_features(trainer.runner, [s for s, _ in seqs], tuple(trainer.draft.config.target_layer_ids))
    with torch.no_grad():
        losses = [trainer.sequence_loss(ids, f.clone(), torch.arange(plen, len(ids) - 1))
                  for (ids, plen), f in zip(seqs, feats)]
    return float(sum(losses) / len(losses))


@ARCHITECTURES
def test_one_step_lowers_loss_on_a_fixed_batch(tiny_target: Path, tmp_path: Path, arch: dict):
    recs = [r for r in records(40, seed=1) if not is_dev_record(r["id"])][:2]
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, anchors_per_seq=64, total_steps=10, **arch), recs)
    before = fixed_batch_loss(trainer, recs)
    stats = trainer.train_step()
    after = fixed_batch_loss(trainer, recs)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert after < before - 1e-3, (before, after)
    frozen = trainer.runner.model.lm_head.weight
    assert not frozen.requires_grad and trainer.draft.fc.weight.requires_grad


@ARCHITECTURES
def test_checkpoint_resumes_to_the_same_state(tiny_target: Path, tmp_path: Path, arch: dict):
    data = records(12, seed=2)
    straight = DFlashTrainer(train_config(tmp_path / "a", tiny_target, **arch), data)
    straight.run()  # 6 steps, checkpoint at 3 and 6
    first = DFlashTrainer(train_config(tmp_path / "b", tiny_target, **arch), data)
    first.run(max_steps=3)
    resumed = DFlashTrainer(train_config(tmp_path / "b", tiny_target, **arch), data,
                            resume_dir=tmp_path / "b" / "latest")
    assert resumed.step == 3 and resumed.data.cursor == first.data.cursor and resumed.data.order == first.data.order
    assert [r["id"] for r in resumed.data.dev] == [r["id"] for r in first.data.dev]
    resumed.run()
    assert resumed.step == straight.step == 6
    for (name, a), b in zip(straight.draft.named_parameters(), resumed.draft.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert resumed.tokens_seen == straight.tokens_seen


def test_feature_cache_trains_exactly_like_fresh_features(tiny_target: Path, tmp_path: Path):
    """Three epochs over six records: the cache is filled in the first and read afterwards, and the
    weights equal a run that computes every feature (bit for bit); a new cache object finds the files."""
    data = [r for r in records(8, seed=6) if not is_dev_record(r["id"])][:6]
    fresh = DFlashTrainer(train_config(tmp_path / "a", tiny_target, total_steps=9), data)
    fresh.run()
    cfg = train_config(tmp_path / "b", tiny_target, total_steps=9, feature_cache=str(tmp_path / "cache"))
    cached = DFlashTrainer(cfg, data)
    cached.run()
    assert cached.data.epoch == fresh.data.epoch >= 2
    for (name, a), b in zip(fresh.draft.named_parameters(), cached.draft.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    reopened = FeatureCache(tmp_path / "cache", str(cfg.model_path), tuple(cached.draft.config.target_layer_ids),
                            cfg.max_len)
    assert not reopened.pending and {r["id"] for r in data} <= set(reopened.where)
    ids, _ = cached.data.sequence(data[0])
    torch.testing.assert_close(reopened.get(data[0]["id"]), cached.features(data[:1], [ids])[0][0], rtol=0, atol=0)


def test_new_records_join_the_epoch_and_the_draft_vocab_survives_resume(tiny_target: Path, tmp_path: Path):
    data = records(10, seed=4)
    cfg = train_config(tmp_path, tiny_target, draft_vocab_size=12, total_steps=3)
    trainer = DFlashTrainer(cfg, data[:6])
    vocab = trainer.draft.config.draft_vocab
    assert len(vocab) == 12 and VOCAB - 1 in vocab  # eos is always proposable
    trainer.run()
    added = trainer.data.add(data)  # the first six again (ignored) and four new ones
    assert added == sum(not is_dev_record(r["id"]) for r in data[6:])
    assert len(trainer.data.order) == len(set(trainer.data.order))
    again = DFlashTrainer(cfg, records(10, seed=5, prefix="other"), resume_dir=tmp_path / "latest")
    assert again.draft.config.draft_vocab == vocab


@ARCHITECTURES
def test_dev_tau_with_the_real_worker(tiny_target: Path, tmp_path: Path, arch: dict):
    dev_ids = [f"d{i}" for i in range(400) if is_dev_record(f"d{i}")][:2]
    data = records(8, seed=6) + [dict(r, id=i) for r, i in zip(records(2, seed=7, prefix="x"), dev_ids)]
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, eval_worker_prompts=2, eval_max_new_tokens=12,
                                         eval_every=2, total_steps=2, **arch), data)
    assert [r["id"] for r in trainer.data.dev] == dev_ids and not set(dev_ids) & set(trainer.data.order)
    trainer.run(log_path=tmp_path / "history.jsonl")
    entry = trainer.history[-1]
    assert 1.0 <= entry["dev_tau"] <= BLOCK and 1.0 <= entry["dev_tau_teacher_forced"] <= BLOCK
    assert (tmp_path / "history.jsonl").read_text().count("dev_tau") == 2


def test_written_drafter_folds_the_feature_scale(tiny_target: Path, tmp_path: Path):
    from sglang_dflash.models.dflash import load_draft_model

    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, total_steps=1), records(6, seed=8))
    assert trainer.feature_scale.shape == (2 * 32,) and not torch.allclose(trainer.feature_scale, torch.ones(64))
    trainer.run()
    saved = load_draft_model(tmp_path / "latest", torch.device("cpu"), torch.float32)
    raw = torch.randn(9, 64) * 30
    with torch.no_grad():
        torch.testing.assert_close(saved.project_context(raw),
                                   trainer.draft.project_context(raw / trainer.feature_scale), rtol=1e-4, atol=1e-4)


def test_init_from_a_written_drafter_continues_the_same_function(tiny_target: Path, tmp_path: Path):
    """A run started from a public-format checkpoint (measuring its own feature scale on other records)
    computes what the run that wrote it computed, and its config (incl. the draft vocab) is kept."""
    first = DFlashTrainer(train_config(tmp_path / "a", tiny_target, draft_vocab_size=12, total_steps=3),
                          records(6, seed=9))
    first.run()
    cfg = train_config(tmp_path / "b", tiny_target, draft_vocab_size=None, init_from=str(tmp_path / "a" / "latest"))
    dev_ids = [f"d{i}" for i in range(400) if is_dev_record(f"d{i}")][:2]
    dev = [dict(r, id=i) for r, i in zip(records(2, seed=11, prefix="x"), dev_ids)]
    second = DFlashTrainer(cfg, records(6, seed=10, prefix="new") + dev)
    assert second.draft.config.draft_vocab == first.draft.config.draft_vocab
    assert not torch.allclose(second.feature_scale, first.feature_scale)
    raw = torch.randn(9, 64) * 30
    with torch.no_grad():
        torch.testing.assert_close(second.draft.project_context(raw / second.feature_scale),
                                   first.draft.project_context(raw / first.feature_scale), rtol=1e-4, atol=1e-4)
    recs = [r for r in records(6, seed=10, prefix="new") if not is_dev_record(r["id"])][:2]
    torch.testing.assert_close(fixed_batch_loss(second, recs), fixed_batch_loss(first, recs), rtol=1e-4, atol=1e-4)
    second.run(max_steps=1)  # the starting point is evaluated first: the curve's step 0
    assert [h["step"] for h in second.history] == [0, 1] and 1.0 <= second.history[0]["dev_tau_teacher_forced"] <= BLOCK


def test_init_layers_from_the_target_copies_its_last_layers(tiny_target: Path, tmp_path: Path):
    """init_layers='target': draft layer i is target layer N - n + i, and the context path passes the last
    captured layer's hidden state through the input norm of the layer after it."""
    from sglang_dflash.models.llama import RMSNorm
    from sglang_dflash.models.model_store import load_weights

    with pytest.raises(ValueError, match="init_layers"):
        DFlashTrainer(train_config(tmp_path / "x", tiny_target, init_layers="first"), records(6, seed=12))
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, init_layers="target"), records(6, seed=12))
    target = load_weights(tiny_target)
    for i, layer in enumerate(trainer.draft.layers):
        for name in ("input_layernorm", "self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            torch.testing.assert_close(layer.get_submodule(name).weight, target[f"model.layers.{6 + i}.{name}.weight"])
    norm = RMSNorm(32, trainer.draft.config.rms_norm_eps)
    last = trainer.draft.config.target_layer_ids[-1]
    norm.weight.data.copy_(target[f"model.layers.{last + 1}.input_layernorm.weight"])
    raw = torch.randn(9, 64) * 30
    with torch.no_grad():
        torch.testing.assert_close(trainer.draft.project_context(raw / trainer.feature_scale), norm(raw[:, 32:]),
                                   rtol=1e-4, atol=1e-4)


def test_teacher_forced_eval_skips_dev_prompts_longer_than_max_len(tiny_target: Path, tmp_path: Path):
    dev_ids = [f"d{i}" for i in range(400) if is_dev_record(f"d{i}")][:2]
    long = dict(records(1, seed=12)[0], id=dev_ids[0], prompt_ids=[7] * 70)  # max_len is 64
    short = dict(records(1, seed=13)[0], id=dev_ids[1])
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target), records(4, seed=14) + [long, short])
    assert [r["id"] for r in trainer.data.dev] == dev_ids
    assert 1.0 <= trainer.eval_tau_teacher_forced() <= BLOCK


# ---------------------------------------------------------------- DFlash 2


def test_selector_candidates_insert_the_gold_where_it_falls_outside():
    g = torch.Generator().manual_seed(20)
    logits, top_k = torch.randn(5, 3, 30, generator=g), 4
    labels = torch.randint(0, 30, (5, 3), generator=g)
    labels[0, 0] = logits[0, 0].argmax()
    labels[1, 2] = -100
    cands, target = selector_candidates(logits, labels, top_k)
    for i in range(5):
        for j in range(3):
            expect = logits[i, j].topk(top_k).indices.tolist()
            gold = int(labels[i, j])
            if gold >= 0 and gold not in expect:
                expect[-1] = gold
            assert cands[i, j].tolist() == expect
            if gold >= 0:
                assert expect[int(target[i, j])] == gold
    assert int(labels[0, 0]) == int(cands[0, 0, 0])  # the argmax is always a candidate


def test_teacher_forced_picks_equal_the_selector_path(tiny_target: Path, tmp_path: Path):
    """Given the selector's own greedy path as the predecessors, the teacher-forced drafts are that
    path (so teacher-forced tau is the real worker's rule), on a selector whose pair term is not silent."""
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, **DFLASH2), records(4, seed=21))
    selector = trainer.draft.candidate_selector
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.randn(selector.hidden_projection.weight.shape, generator=g))
        for book in (selector.predecessor_codebook, selector.successor_codebook):
            book.copy_(torch.randn(book.shape, generator=g))
        x = trainer.draft.norm(torch.randn(6, BLOCK - 1, 32, generator=g))
        logits = trainer.draft.shape_logits(torch.nn.functional.linear(x, trainer.head))
        anchors = torch.randint(0, VOCAB, (6,), generator=g)
        unary, top = logits.topk(selector.top_k, dim=-1)
        path, _ = selector.select(x, unary, top, anchors, None, None)
        prev = torch.cat([anchors[:, None], path[:, :-1]], 1)
        assert torch.equal(trainer.draft.teacher_forced_drafts(x, logits, prev), path)
        assert not torch.equal(path, logits.argmax(-1))  # the pair term changes the path


def test_dflash1_checkpoint_warm_starts_dflash2_exactly(tiny_target: Path, tmp_path: Path):
    """A DFlash 2 run started from a DFlash 1 checkpoint computes what DFlash 1 computes (block loss,
    teacher-forced tau) until it trains; then its convolutions and selector move, and it writes a DFlash 2
    checkpoint (the engine loads it by its architecture: test_dev_tau_with_the_real_worker[dflash2])."""
    dev_ids = [f"d{i}" for i in range(400) if is_dev_record(f"d{i}")][:2]
    data = records(6, seed=23) + [dict(r, id=i) for r, i in zip(records(2, seed=24, prefix="x"), dev_ids)]
    first = DFlashTrainer(train_config(tmp_path / "a", tiny_target, total_steps=3), data)
    first.run()
    second = DFlashTrainer(train_config(tmp_path / "b", tiny_target, init_from=str(tmp_path / "a" / "latest"),
                                        **DFLASH2), data)
    recs = [r for r in data if not is_dev_record(r["id"])][:2]
    with torch.no_grad():
        for rec in recs:
            ids, plen = first.data.sequence(rec)
            feats = first.features([rec], [ids])[0][0]
            anchors = torch.arange(plen, len(ids) - 1)
            _, logits1, labels1, _ = first.block_outputs(ids, feats, anchors)
            _, logits2, labels2, _ = second.block_outputs(ids, feats, anchors)
            torch.testing.assert_close(logits2, logits1, rtol=1e-5, atol=1e-5)
    assert second.eval_tau_teacher_forced() == pytest.approx(first.eval_tau_teacher_forced(), abs=1e-9)
    second.run(max_steps=2)
    layer, selector = second.draft.layers[0], second.draft.candidate_selector
    assert layer.attention_conv.kernel_projection.weight.abs().sum() > 0
    assert selector.hidden_projection.weight.abs().sum() > 0
    assert isinstance(DFlashConfig.load(tmp_path / "b" / "latest"), DFlash2Config)


def test_time_budget_shrinks_total_steps(tiny_target: Path, tmp_path: Path):
    """After the first step and BUDGET_PROBE_STEPS timed ones, total_steps becomes what fits the budget (here: those
    alone), and the lr schedule ends there."""
    trainer = DFlashTrainer(train_config(tmp_path, tiny_target, total_steps=1000, time_budget_s=1e-6), records(12, 5))
    trainer.run()
    assert trainer.step == trainer.cfg.total_steps == 1 + BUDGET_PROBE_STEPS
    assert lr_at(trainer.step, trainer.cfg) == 0.0


def test_scaling_curve_trains_nested_sizes_on_one_dev_set(tiny_target: Path, tmp_path: Path):
    """scripts/scaling_curve.py at tiny size: one run per size on nested subsets, the same held-out records, a fit
    and a plot; a second invocation reuses the finished sizes."""
    data = records(300, seed=6)
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "shard_00000.npz", data)
    dev_ids = [r["id"] for r in data if is_dev_record(r["id"])][:2]
    assert len(dev_ids) == 2
    cmd = [sys.executable, str(ROOT / "scripts" / "scaling_curve.py"), "--data", str(tmp_path / "data"),
           "--out", str(tmp_path / "out"), "--sizes", "4,8", "--epochs", "1", "--min-steps", "2", "--dev-size", "2",
           "--model-path", str(tiny_target), "--num-layers", "2", "--num-target-layers-used", "2",
           "--block-size", str(BLOCK), "--mask-token-id", str(MASK), "--anchors-per-seq", "4", "--max-len", "64",
           "--seqs-per-step", "2", "--autocast-bf16", "false"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert [r["size"] for r in summary["results"]] == [4, 8] and [r["steps"] for r in summary["results"]] == [2, 4]
    assert all(math.isfinite(r["dev_tau_teacher_forced"]) for r in summary["results"])
    assert math.isfinite(summary["fit"]["b"]) and (tmp_path / "out" / "scaling.png").stat().st_size > 0
    states = [torch.load(tmp_path / "out" / f"size_{n}" / "latest" / "train_state.pt", weights_only=False)
              for n in (4, 8)]
    assert all(state["dev"] == dev_ids for state in states)
    assert set(states[0]["order"]) < set(states[1]["order"])  # nested subsets
    summary_8 = summary["results"][1]
    before = (tmp_path / "out" / "size_8" / "result.json").stat().st_mtime_ns
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assert (tmp_path / "out" / "size_8" / "result.json").stat().st_mtime_ns == before
    # --one-pass: one run, evaluated as it passes each size, constant lr; a rerun measures nothing again
    one = [*cmd, "--one-pass", "--sizes", "4,8,12"]
    subprocess.run(one, check=True, capture_output=True, timeout=300)
    summary = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert summary["one_pass"] and [r["steps"] for r in summary["results"]] == [2, 4, 6]
    history = [json.loads(line) for line in (tmp_path / "out" / "one_pass" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [2, 4, 6] and len({h["lr"] for h in history}) == 1
    state = torch.load(tmp_path / "out" / "one_pass" / "latest" / "train_state.pt", weights_only=False)
    assert state["dev"] == dev_ids and len(state["order"]) == 12
    before = (tmp_path / "out" / "one_pass" / "results.json").stat().st_mtime_ns
    subprocess.run([*one, "--reference", str(tmp_path / "out" / "size_8" / "latest")], check=True,
                   capture_output=True, timeout=300)
    assert (tmp_path / "out" / "one_pass" / "results.json").stat().st_mtime_ns == before
    reference = json.loads((tmp_path / "out" / "scaling.json").read_text())["reference"]
    assert reference["dev_tau_teacher_forced"] == pytest.approx(summary_8["dev_tau_teacher_forced"], abs=1e-6)


def test_target_labels_are_the_targets_greedy_next_tokens(tiny_target: Path, tmp_path: Path):
    """labels='target': each label is the target's argmax after the prefix before it (checked against one forward
    per prefix), so a response that is the target's greedy continuation keeps its labels and a random one does not."""
    from sglang_dflash.training.features import target_pass

    trainer = DFlashTrainer(train_config(tmp_path / "a", tiny_target, labels="target"), records(6, seed=7))
    layers = tuple(trainer.draft.config.target_layer_ids)
    rec = trainer.data.records[trainer.data.order[0]]
    ids, plen = trainer.data.sequence(rec)
    (feats,), (next_logits,) = trainer.features([rec], [ids], next_logits=True)
    greedy_next = next_logits.argmax(-1)
    expect = [int(target_pass(trainer.runner, [ids[:p]], layers, next_logits=True)[1][0][-1].argmax())
              for p in range(plen, len(ids))]
    assert greedy_next[plen - 1 : -1].tolist() == expect
    anchors = torch.arange(plen, len(ids) - 1)
    _, _, labels, _ = trainer.block_outputs(ids, feats, anchors, greedy_next)
    assert labels[:, 0].tolist() == expect[1:]  # label 1 of the block at anchor a: the argmax after ids[:a+1]
    greedy = dict(rec, id="greedy", response_ids=[])
    for _ in range(12):  # the target's greedy continuation, token by token
        seq = greedy["prompt_ids"] + greedy["response_ids"]
        nxt = int(target_pass(trainer.runner, [seq], layers, next_logits=True)[1][0][-1].argmax())
        greedy["response_ids"] = greedy["response_ids"] + [nxt]
    relabeled = []
    for name, data in (("b", [greedy, dict(greedy, id="greedy2")]), ("c", records(2, seed=8))):
        cfg = train_config(tmp_path / name, tiny_target, labels="target", dev_size=0)
        relabeled.append(DFlashTrainer(cfg, data).train_step()["relabeled"])
    assert relabeled[0] == 0 and relabeled[1] > 0.5, relabeled
    with pytest.raises(ValueError, match="feature-cache"):
        DFlashTrainer(train_config(tmp_path / "d", tiny_target, labels="target", feature_cache=str(tmp_path)), [])


def test_soft_loss_with_one_hot_targets_is_the_hard_loss():
    """soft_block_targets row a+k-1 is label k's distribution; with one-hot distributions of the hard labels the
    soft loss equals the hard one (random logits, odd sizes, a label past the end)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 37, (21,), generator=g)
    anchors = torch.tensor([0, 7, 18])
    labels = block_labels(ids, anchors, 5)
    probs = torch.nn.functional.one_hot(torch.cat([ids[1:], ids[:1]]), 37).float()  # row i: the token i+1
    rows, valid = soft_block_targets(probs, anchors, 5)
    assert valid.tolist() == (labels >= 0).tolist()
    logits = torch.randn(3, 4, 37, generator=g)
    ws = position_weights(5, 2.0)
    soft_loss = weighted_soft_block_loss(logits, rows, valid, ws)
    torch.testing.assert_close(soft_loss, weighted_block_loss(logits, labels, ws))


def test_soft_labels_are_the_targets_distributions_over_the_draft_vocabulary(tiny_target: Path, tmp_path: Path):
    """labels='soft': the target's next-token distribution restricted to the draft vocabulary, renormalised; its
    argmax is the hard target label wherever that token is in the draft vocabulary; training runs on it."""
    trainer = DFlashTrainer(train_config(tmp_path / "s", tiny_target, labels="soft", draft_vocab_size=12),
                            records(6, seed=7))
    rec = trainer.data.records[trainer.data.order[0]]
    ids, plen = trainer.data.sequence(rec)
    _, (next_logits,) = trainer.features([rec], [ids], next_logits=True)
    soft = trainer.soft_targets(next_logits)
    vocab = trainer.draft.draft_vocab
    assert soft.shape == (len(ids), len(vocab))
    torch.testing.assert_close(soft.sum(-1), torch.ones(len(ids)))
    torch.testing.assert_close(soft, torch.softmax(next_logits[:, vocab].float(), -1))
    greedy = next_logits.argmax(-1)
    inside = trainer.label_index[greedy] >= 0
    assert inside.any()
    assert (soft.argmax(-1)[inside] == trainer.label_index[greedy][inside]).all()
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
