"""DFlash draft trainer, the loop: on-the-fly (or cached) target features, many anchor blocks per sequence
in one forward, weighted block loss, AdamW with warmup + cosine, periodic dev evaluation and checkpoints.

The target's residual streams have massive-activation dimensions (SmolLM2: one dimension with RMS ~2700
against a median of ~10), which made every projected context vector nearly the same at initialisation
(mean pairwise cosine 0.61, still 0.53 after 300 steps, loss stuck near 5.8). So `fc` is trained on
features divided by their per-dimension RMS (measured once on training data); see checkpoint.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_dflash.device import has_fast_bf16, resolve_device
from sglang_dflash.kernels.argmax import argmax
from sglang_dflash.models.dflash import DFlashDraftModel, random_draft_model
from sglang_dflash.models.dflash2 import DFlash2Config, dflash1_equivalent_, random_dflash2_model
from sglang_dflash.models.dflash_config import DFlashConfig, default_target_layer_ids
from sglang_dflash.models.model_store import load_weights
from sglang_dflash.runtime.model_runner import ModelRunner
from sglang_dflash.training.block_attention import draft_blocks_forward
from sglang_dflash.training.checkpoint import load_checkpoint, load_drafter, save_checkpoint, write_drafter
from sglang_dflash.training.data import TrainData, sample_anchors
from sglang_dflash.training.draft_vocab import most_frequent_tokens, target_to_draft_index
from sglang_dflash.training.evaluate import dev_tau, drafter_runs
from sglang_dflash.training.feature_cache import FeatureCache
from sglang_dflash.training.features import TrainingFeatures
from sglang_dflash.training.loss import (
    block_labels,
    default_gamma,
    position_weights,
    selector_loss,
    soft_block_targets,
    weighted_block_loss,
    weighted_soft_block_loss,
)
from sglang_dflash.training.warm_start import init_from_target_layers_


@dataclass
class TrainConfig:
    out_dir: str
    model_path: str | None = None
    num_layers: int = 3
    num_target_layers_used: int = 5
    block_size: int = 16
    mask_token_id: int = 16
    anchors_per_seq: int = 128  # 2.3x the anchor blocks per CPU-second of 32 (README, "Training a drafter")
    max_len: int = 512
    seqs_per_step: int = 4
    total_steps: int = 2000
    lr: float = 1e-3
    lr_schedule: str = "cosine"  # after the warm-up: "cosine" to 0 at total_steps, or "constant"
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    # "data": the response's own next tokens; "target": the target's greedy next token after each position of the
    # same pass (what greedy verification accepts; differs from the data on sampled responses); "soft": the
    # target's next-token distribution over the draft vocabulary from that pass (cross-entropy against it)
    labels: str = "data"
    draft_vocab_size: int | None = 8192
    ckpt_every: int = 100
    eval_every: int = 100
    dev_size: int = 24
    seed: int = 0
    autocast_bf16: bool | None = None  # None: where bf16 is native (see device.has_fast_bf16)
    attention: str = "split"  # "split" (context | own block, one softmax), "sdpa" (dense mask) or "flex"
    eval_worker_prompts: int = 8  # dev prompts decoded by the real DFlashWorker at each evaluation (0 = off)
    eval_max_new_tokens: int = 96
    feature_cache: str | None = None  # directory for cached bf16 target features (~6 KB per token)
    init_from: str | None = None  # a DFlash checkpoint directory to start from (its config and weights)
    # "random", or "target": layers from the target's last layers (training/warm_start.py); ignored with init_from
    init_layers: str = "random"
    # "dflash2": convolutions + candidate selector, started silent (identity convolutions, no selector pair
    # term), so a DFlash 1 --init-from warm-starts it exactly; the next five fields shape the additions
    architecture: str = "dflash"
    conv_kernel_size: int = 4
    conv_group_size: int = 64
    selector_rank: int = 32
    selector_top_k: int = 8
    selector_loss_weight: float = 1.0
    device: str = "cpu"  # cpu, cuda or xpu: the target's features, the draft and the dev evaluation
    # wall-clock budget: after the first steps total_steps shrinks to what fits (the lr schedule follows)
    time_budget_s: float | None = None


def add_config_flags(ap: argparse.ArgumentParser, skip: tuple[str, ...] = ("out_dir",)) -> None:
    """A --flag per TrainConfig field but `skip` (default None: the field's own default applies)."""
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", "bool | None"):
            ap.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None)
        else:
            ap.add_argument(flag, type={"int": int, "float": float}.get(str(f.type).split(" ")[0], str), default=None)


def config_overrides(args: argparse.Namespace) -> dict:
    """The TrainConfig fields given on the command line (add_config_flags)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in fields and v is not None}


BUDGET_PROBE_STEPS = 5  # steps timed (after the first) before a time budget sets total_steps (evaluations and a
# resumed run's re-plan come on top)


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.total_steps * cfg.warmup_frac))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    t = (step - warm) / max(1, cfg.total_steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


class DFlashTrainer:
    def __init__(self, cfg: TrainConfig, records: list[dict], resume_dir: Path | None = None):
        """`resume_dir`: a training checkpoint to continue exactly (its draft config, incl. the draft
        vocabulary, weights, optimizer, data order and RNG state)."""
        if cfg.attention == "flex":  # measured: torch 2.13 raises NotImplementedError in flex backward on CPU
            raise ValueError("attention='flex' needs a GPU: flex_attention has no backward on CPU; use 'sdpa'")
        if cfg.labels not in ("data", "target", "soft") or cfg.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"labels must be 'data', 'target' or 'soft' (got {cfg.labels!r}), lr_schedule 'cosine' or "
                             f"'constant' (got {cfg.lr_schedule!r})")
        if cfg.init_layers not in ("random", "target"):
            raise ValueError(f"init_layers must be 'random' or 'target', got {cfg.init_layers!r}")
        if cfg.labels != "data" and cfg.feature_cache:
            raise ValueError(f"labels={cfg.labels!r} needs the target's logits every step: "
                             "train without --feature-cache")
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.bf16 = has_fast_bf16(self.device) if cfg.autocast_bf16 is None else cfg.autocast_bf16
        tokens = cfg.seqs_per_step * cfg.max_len + 64
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.runner = ModelRunner(cfg.model_path, self.device, dtype, tokens, cfg.seqs_per_step + 1)
        self.data = TrainData(cfg.seed, cfg.dev_size, cfg.max_len)
        self.data.add(records)
        self.step = 0
        dcfg = self.draft_config(resume_dir or (Path(cfg.init_from) if cfg.init_from else None))
        # norms start at one: copying the target's final-norm scale (~1.8) gave a higher loss for the first
        # 24 steps (measured: 9.8 vs 8.4 at step 24, lr 1e-3)
        if isinstance(dcfg, DFlash2Config):
            self.draft: DFlashDraftModel = dflash1_equivalent_(random_dflash2_model(dcfg, seed=cfg.seed))
        else:
            self.draft = random_draft_model(dcfg, seed=cfg.seed)
        self.draft.to(self.device)
        self.draft.bind_target(self.runner.model.model.embed_tokens, self.runner.model.lm_head)
        self.draft.prepare_inference(self.device)
        head = self.runner.model.lm_head.weight
        vocab = None if dcfg.draft_vocab is None else torch.tensor(dcfg.draft_vocab, device=self.device)
        self.head = (head if vocab is None else head[vocab]).detach().float()
        vocab_size = self.runner.model_config.vocab_size
        self.label_index = (
            None if vocab is None else target_to_draft_index(dcfg.draft_vocab, vocab_size).to(self.device)
        )
        self.weights = position_weights(cfg.block_size, cfg.gamma or default_gamma(cfg.block_size), self.device)
        layers = tuple(dcfg.target_layer_ids)
        cache = None
        if cfg.feature_cache:
            cache = FeatureCache(Path(cfg.feature_cache), str(cfg.model_path), layers, cfg.max_len)
        self.features = TrainingFeatures(self.runner, layers, cache)
        if resume_dir is None:  # (a resumed run takes the scale from its checkpoint)
            first = [self.data.sequence(self.data.records[i])[0] for i in self.data.order[:16]]
            self.feature_scale = self.features.rms(first, cfg.seqs_per_step)
            if cfg.init_from:
                load_drafter(self.draft, self.feature_scale, Path(cfg.init_from))
            elif cfg.init_layers == "target":
                init_from_target_layers_(self.draft, load_weights(self.runner.model_dir), self.feature_scale,
                                         self.runner.model_config.num_hidden_layers)
                self.draft.prepare_inference(self.device)
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict] = []
        self.tokens_seen = 0
        if resume_dir is not None:
            load_checkpoint(self, resume_dir)

    def draft_config(self, checkpoint: Path | None) -> DFlashConfig:
        """The checkpoint's draft config, or a new one for the target (with a draft vocabulary from the data)."""
        cfg, tcfg = self.cfg, self.runner.model_config
        if cfg.architecture not in ("dflash", "dflash2"):
            raise ValueError(f"architecture must be 'dflash' or 'dflash2', got {cfg.architecture!r}")
        if checkpoint is not None:
            dcfg = DFlashConfig.load(checkpoint)
            if dcfg.block_size != cfg.block_size:
                raise ValueError(f"checkpoint block size {dcfg.block_size} != --block-size {cfg.block_size}")
            if isinstance(dcfg, DFlash2Config) and cfg.architecture == "dflash":
                raise ValueError(f"{checkpoint} is a DFlash 2 checkpoint: pass --architecture dflash2")
        else:
            dcfg = DFlashConfig.for_target(tcfg, cfg.num_layers, cfg.block_size, cfg.mask_token_id)
            dcfg.target_layer_ids = default_target_layer_ids(cfg.num_target_layers_used, tcfg.num_hidden_layers)
            if cfg.draft_vocab_size:
                dcfg.draft_vocab = most_frequent_tokens(self.data.responses(), cfg.draft_vocab_size,
                                                        always=tcfg.eos_token_ids)
        if cfg.architecture == "dflash2" and not isinstance(dcfg, DFlash2Config):
            dcfg = DFlash2Config.extend(dcfg, cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank,
                                        cfg.selector_top_k)
        return dcfg

    # ---- one sequence ----
    def block_outputs(self, ids: list[int], feats: torch.Tensor, anchors: torch.Tensor,
                      greedy_next: torch.Tensor | None = None):
        """Of every anchor block's predicted rows 1..B-1: normed states x [m, B-1, H], logits [m, B-1, V]
        (draft vocabulary), labels [m, B-1] (draft ids, -100 = ignore) and the gold predecessors [m, B-1].
        `greedy_next` [len(ids)]: the target's greedy next tokens, the labels instead of the data's own."""
        block = self.cfg.block_size
        input_ids = torch.tensor(ids, device=self.device)
        gold = input_ids if greedy_next is None else torch.cat([input_ids[:1], greedy_next[:-1].to(self.device)])
        anchors = anchors.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            feats = feats.float() / self.feature_scale
            h = draft_blocks_forward(self.draft, feats, input_ids, anchors, block, self.cfg.attention)
            x = self.draft.norm(h).view(len(anchors), block, -1)[:, 1:]
            logits = F.linear(x.flatten(0, 1), self.head.to(x.dtype))  # 2-D GEMM, not bmm
            logits = self.draft.shape_logits(logits).view(len(anchors), block - 1, -1)
        labels = block_labels(gold, anchors, block)
        if self.label_index is not None:
            labels = torch.where(labels >= 0, self.label_index[labels.clamp_min(0)], -100)
        prev = block_labels(gold, anchors - 1, block).clamp_min(0)  # each label's predecessor: x_a, then labels
        prev[:, 0] = input_ids[anchors]
        return x, logits, labels, prev

    def soft_targets(self, next_logits: torch.Tensor) -> torch.Tensor:
        """The target's next-token distributions [n, V] restricted (and renormalised) to the draft vocabulary."""
        vocab = self.draft.draft_vocab
        logits = next_logits if vocab is None else next_logits[:, vocab]
        return torch.softmax(logits.float(), dim=-1)

    def sequence_loss(self, ids: list[int], feats: torch.Tensor, anchors: torch.Tensor,
                      greedy_next: torch.Tensor | None = None, soft: torch.Tensor | None = None) -> torch.Tensor:
        """`soft` [len(ids), V_draft]: the target's distributions (labels='soft'), else hard labels."""
        x, logits, labels, prev = self.block_outputs(ids, feats, anchors, greedy_next)
        if soft is None:
            loss = weighted_block_loss(logits, labels, self.weights)
        else:
            probs, valid = soft_block_targets(soft, anchors.to(self.device), self.cfg.block_size)
            loss = weighted_soft_block_loss(logits, probs, valid, self.weights)
        if isinstance(self.draft.config, DFlash2Config):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                sel = selector_loss(self.draft.candidate_selector, x, logits, labels, prev,
                                    self.draft.map_draft_tokens, self.weights)
            loss = loss + self.cfg.selector_loss_weight * sel
        return loss

    def train_step(self) -> dict:
        cfg = self.cfg
        recs = self.data.next_batch(cfg.seqs_per_step)
        seqs = [self.data.sequence(r) for r in recs]
        feats, next_logits = self.features(recs, [s for s, _ in seqs], next_logits=cfg.labels != "data")
        nexts = None if next_logits is None else [argmax(lg) for lg in next_logits]
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        self.opt.zero_grad(set_to_none=True)
        total, count, relabeled, response_tokens = 0.0, 0, 0, 0
        for i, ((ids, plen), f) in enumerate(zip(seqs, feats)):
            anchors = sample_anchors(plen, len(ids), cfg.anchors_per_seq, self.gen)
            if len(anchors) == 0:
                continue
            soft = self.soft_targets(next_logits[i]) if cfg.labels == "soft" else None
            loss = self.sequence_loss(ids, f.clone(), anchors, None if nexts is None else nexts[i], soft)
            (loss / len(seqs)).backward()
            if nexts is not None:  # response tokens that are not the target's greedy choice
                relabeled += int((nexts[i][plen - 1 : -1].cpu() != torch.tensor(ids[plen:])).sum())
                response_tokens += len(ids) - plen
            total += loss.item()
            count += 1
            self.tokens_seen += len(ids)
        norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        lr = lr_at(self.step - 1, cfg)
        stats = {"step": self.step, "loss": total / max(count, 1), "grad_norm": float(norm), "lr": lr}
        if nexts is not None:
            stats["relabeled"] = relabeled / max(response_tokens, 1)
        return stats

    # ---- evaluation ----
    @torch.no_grad()
    def eval_tau_teacher_forced(self) -> float:
        """Mean committed tokens per block (accepted drafts + 1) when drafting greedily from EVERY
        position of the dev greedy responses (cheap; a proxy for the real worker's tau)."""
        taus = []
        dev, batch = self.data.dev, self.cfg.seqs_per_step
        greedy = [r for r in dev if r["sampling"].get("temperature", 1.0) == 0] or dev
        seqs = [self.data.sequence(r) for r in greedy]
        for start in range(0, len(seqs), batch):
            chunk = seqs[start : start + batch]
            feats, _ = self.features(greedy[start : start + batch], [s for s, _ in chunk])
            for (ids, plen), f in zip(chunk, feats):
                if len(ids) - 1 <= plen:  # no response left within max_len
                    continue
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    run = drafter_runs(self.draft, f.float() / self.feature_scale, ids, plen)
                taus.append(float((run + 1).float().mean()))
        return sum(taus) / len(taus) if taus else float("nan")

    def evaluate(self, stats: dict, wall_s: float, log_path: Path | None) -> None:
        """Adds the dev-set taus to `stats` (the real DFlashWorker's with eval_worker_prompts), appends it to
        the history (and the log file) and prints it."""
        cfg = self.cfg
        stats["dev_tau_teacher_forced"] = self.eval_tau_teacher_forced()
        if cfg.eval_worker_prompts:
            write_drafter(self.draft, self.feature_scale, self.out / "eval")
            prompts = [r["prompt_ids"] for r in self.data.dev[: cfg.eval_worker_prompts]]
            stats["dev_tau"] = dev_tau(self.out / "eval", prompts, cfg.model_path, cfg.eval_max_new_tokens, cfg.device)
        stats.update(tokens_seen=self.tokens_seen, train_records=len(self.data.order), epoch=self.data.epoch,
                     wall_s=round(wall_s, 1))
        self.history.append(stats)
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(stats) + "\n")
        tqdm.write(json.dumps(stats))

    def save(self, tag: str = "latest") -> Path:
        path = self.out / tag
        save_checkpoint(self, path)
        return path

    def run(self, max_steps: int | None = None, log_path: Path | None = None, reload=None) -> None:
        """Trains until total_steps (or max_steps more). `reload()` -> new records, called at checkpoints.
        A run started from a checkpoint (--init-from) or the target's layers first evaluates it: the curve's
        step 0."""
        cfg = self.cfg
        end = min(cfg.total_steps, self.step + max_steps) if max_steps else cfg.total_steps
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train", unit="step")
        t0, tok0 = time.perf_counter(), self.tokens_seen
        if self.step == 0 and (cfg.init_from or cfg.init_layers != "random"):
            self.evaluate({"step": 0, "init_from": cfg.init_from or cfg.init_layers}, 0.0, log_path)
        first, probe_t0 = self.step, time.perf_counter()
        while self.step < end:
            stats = self.train_step()
            if self.step - first == 1:  # the first step pays one-off set-up (allocator, kernels): not timed
                probe_t0 = time.perf_counter()
            if cfg.time_budget_s and self.step - first == 1 + BUDGET_PROBE_STEPS:
                per_step = (time.perf_counter() - probe_t0) / BUDGET_PROBE_STEPS
                fits = max(1 + BUDGET_PROBE_STEPS, int((cfg.time_budget_s - (probe_t0 - t0)) / per_step))
                cfg.total_steps = min(cfg.total_steps, first + fits)
                end = min(end, cfg.total_steps)
                bar.total = cfg.total_steps
            bar.update(1)
            rate = (self.tokens_seen - tok0) / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{rate:.0f}", data=len(self.data.order))
            if self.step % cfg.eval_every == 0 or self.step == end:
                self.evaluate(stats, time.perf_counter() - t0, log_path)
            if self.step % cfg.ckpt_every == 0 or self.step == end:
                self.save()
                if reload is not None:
                    self.data.add(reload())
        bar.close()
