"""DFlash draft trainer: on-the-fly target features, many anchor blocks per sequence in one
forward, weighted block loss, AdamW with warmup + cosine, checkpoints that resume exactly.

The target's residual streams have massive-activation dimensions (SmolLM2: one dimension with RMS ~2700
against a median of ~10), which made every projected context vector nearly the same at initialisation
(mean pairwise cosine 0.61, still 0.53 after 300 steps, loss stuck near 5.8). So `fc` is trained on
features divided by their per-dimension RMS (measured once on training data) and the scale is folded
into fc.weight when a checkpoint is written: the saved drafter is the plain public format.

The data may grow between runs (regeneration and training can overlap): records not seen before are
appended to the current epoch's order, and the order itself is part of the checkpoint."""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from sglang_dflash.device import has_fast_bf16, resolve_device
from sglang_dflash.engine.model_runner import ModelRunner
from sglang_dflash.models.dflash import DFlashDraftModel, random_draft_model
from sglang_dflash.models.dflash_config import DFlashConfig, default_target_layer_ids
from sglang_dflash.training.block_attention import draft_blocks_forward
from sglang_dflash.training.draft_vocab import coverage, most_frequent_tokens, target_to_draft_index
from sglang_dflash.training.evaluate import dev_tau
from sglang_dflash.training.feature_cache import FeatureCache
from sglang_dflash.training.features import target_features
from sglang_dflash.training.loss import block_labels, default_gamma, position_weights, weighted_block_loss


@dataclass
class TrainConfig:
    out_dir: str
    model_path: str | None = None
    num_layers: int = 3
    num_target_layers_used: int = 5
    block_size: int = 16
    mask_token_id: int = 16
    anchors_per_seq: int = 32
    max_len: int = 512
    seqs_per_step: int = 4
    total_steps: int = 2000
    lr: float = 1e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
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
    device: str = "cpu"  # cpu, cuda or xpu: the target's features, the draft and the dev evaluation


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.total_steps * cfg.warmup_frac))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.total_steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def is_dev_record(record_id: str) -> bool:
    """About 2% of prompts, chosen by a hash of their id: the split stays put as data grows."""
    return int(hashlib.sha1(record_id.encode()).hexdigest(), 16) % 50 == 0


def sample_anchors(prompt_len: int, seq_len: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Anchor positions a in [prompt_len, seq_len - 2]: the block [x_a, MASK...] predicts x_(a+1).."""
    lo, hi = prompt_len, seq_len - 1
    n = hi - lo
    if n <= 0:
        return torch.empty(0, dtype=torch.int64)
    pick = torch.randperm(n, generator=gen)[: min(count, n)]
    return (lo + pick).sort().values


class DFlashTrainer:
    def __init__(self, cfg: TrainConfig, records: list[dict], resume_dir: Path | None = None):
        """`resume_dir`: a training checkpoint to continue exactly (its draft config, incl. the draft
        vocabulary, weights, optimizer, data order and RNG state)."""
        if cfg.attention == "flex":  # measured: torch 2.13 raises NotImplementedError in flex backward on CPU
            raise ValueError("attention='flex' needs a GPU: flex_attention has no backward on CPU; use 'sdpa'")
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.bf16 = has_fast_bf16(self.device) if cfg.autocast_bf16 is None else cfg.autocast_bf16
        tokens = cfg.seqs_per_step * cfg.max_len + 64
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.runner = ModelRunner(cfg.model_path, self.device, dtype, tokens, cfg.seqs_per_step + 1)
        tcfg = self.runner.model_config
        self.records: dict[str, dict] = {}
        self.dev: list[dict] = []
        self.order: list[str] = []  # training record ids in this epoch's order
        self.cursor, self.epoch, self.step = 0, 0, 0
        self.add_records(records)
        if resume_dir is not None or cfg.init_from:
            dcfg = DFlashConfig.load(resume_dir or cfg.init_from)
            if dcfg.block_size != cfg.block_size:
                raise ValueError(f"checkpoint block size {dcfg.block_size} != --block-size {cfg.block_size}")
        else:
            dcfg = DFlashConfig.for_target(tcfg, cfg.num_layers, cfg.block_size, cfg.mask_token_id)
            dcfg.target_layer_ids = default_target_layer_ids(cfg.num_target_layers_used, tcfg.num_hidden_layers)
            if cfg.draft_vocab_size:
                responses = [self.records[i]["response_ids"] for i in self.order]
                dcfg.draft_vocab = most_frequent_tokens(responses, cfg.draft_vocab_size, always=tcfg.eos_token_ids)
        # norms start at one: copying the target's final-norm scale (~1.8) gave a higher loss for the first
        # 24 steps (measured: 9.8 vs 8.4 at step 24, lr 1e-3)
        self.draft: DFlashDraftModel = random_draft_model(dcfg, seed=cfg.seed).to(self.device)
        self.draft.bind_target(self.runner.model.model.embed_tokens, self.runner.model.lm_head)
        self.draft.prepare_inference(self.device)
        head = self.runner.model.lm_head.weight
        vocab = None if dcfg.draft_vocab is None else torch.tensor(dcfg.draft_vocab, device=self.device)
        self.head = (head if vocab is None else head[vocab]).detach().float()
        self.label_index = (
            None if vocab is None else target_to_draft_index(dcfg.draft_vocab, tcfg.vocab_size).to(self.device)
        )
        self.weights = position_weights(cfg.block_size, cfg.gamma or default_gamma(cfg.block_size), self.device)
        self.cache = None
        if cfg.feature_cache:
            layers = tuple(dcfg.target_layer_ids)
            self.cache = FeatureCache(Path(cfg.feature_cache), str(cfg.model_path), layers, cfg.max_len)
        if resume_dir is None:  # (a resumed run takes the scale from its checkpoint)
            self.feature_scale = self.measure_feature_scale([self.records[i] for i in self.order[:16]])
            if cfg.init_from:
                self.load_drafter(Path(cfg.init_from))
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict] = []
        self.tokens_seen = 0
        if resume_dir is not None:
            self.resume(resume_dir)

    # ---- data ----
    def add_records(self, records: list[dict]) -> int:
        """Adds records not seen before (dev ones to the dev set until training starts, so the learning
        curve is measured on one set; the rest to the end of this epoch's order, shuffled); returns how
        many training records were added."""
        new = [r for r in records if r["response_ids"] and r["id"] not in self.records]
        for r in new:
            self.records[r["id"]] = r
        if self.step == 0:
            self.dev += [r for r in new if is_dev_record(r["id"])][: max(0, self.cfg.dev_size - len(self.dev))]
        fresh = [r["id"] for r in new if not is_dev_record(r["id"])]
        random.Random(f"{self.cfg.seed}-{len(self.order)}").shuffle(fresh)
        self.order += fresh
        return len(fresh)

    @property
    def vocab_coverage(self) -> float | None:
        vocab = self.draft.config.draft_vocab
        return None if vocab is None else coverage([self.records[i]["response_ids"] for i in self.order], vocab)

    def sequence(self, rec: dict) -> tuple[list[int], int]:
        ids = (rec["prompt_ids"] + rec["response_ids"])[: self.cfg.max_len]
        return ids, min(len(rec["prompt_ids"]), len(ids))

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.cfg.seqs_per_step:
            if self.cursor >= len(self.order):  # next epoch: a fresh shuffle of everything
                self.epoch, self.cursor = self.epoch + 1, 0
                random.Random(f"{self.cfg.seed}-epoch-{self.epoch}").shuffle(self.order)
            batch.append(self.records[self.order[self.cursor]])
            self.cursor += 1
        return batch

    @torch.no_grad()
    def measure_feature_scale(self, recs: list[dict]) -> torch.Tensor:
        """Per-dimension RMS of the captured target features over these records ([K*H], float32)."""
        width = len(self.draft.config.target_layer_ids) * self.draft.config.hidden_size
        if not recs:
            return torch.ones(width, device=self.device)
        seqs = [self.sequence(r)[0] for r in recs]
        total, count = torch.zeros(width, device=self.device), 0
        for start in range(0, len(seqs), self.cfg.seqs_per_step):
            chunk = seqs[start : start + self.cfg.seqs_per_step]
            for f in target_features(self.runner, chunk, tuple(self.draft.config.target_layer_ids)):
                total += f.float().pow(2).sum(0)
                count += f.shape[0]
        return (total / count).sqrt().clamp_min(1e-3)

    def features(self, recs: list[dict], seqs: list[list[int]]) -> list[torch.Tensor]:
        """Target features of these records, rounded to bfloat16 (as the cache stores them, so a run
        with the cache trains exactly like one without): from the cache when there is one (computing
        and adding the missing ones in one batch), otherwise computed."""
        layers = tuple(self.draft.config.target_layer_ids)
        if self.cache is None:
            return [f.to(torch.bfloat16) for f in target_features(self.runner, seqs, layers)]
        found = [self.cache.get(r["id"]) for r in recs]
        found = [None if f is None else f.to(self.device) for f in found]
        missing = [i for i, f in enumerate(found) if f is None or f.shape[0] != len(seqs[i])]
        if missing:
            for i, f in zip(missing, target_features(self.runner, [seqs[i] for i in missing], layers)):
                found[i] = f.to(torch.bfloat16)
                self.cache.put(recs[i]["id"], found[i])
        return found

    def fc_weight_for_checkpoint(self) -> torch.Tensor:
        """fc.weight acting on raw features: the trained weight with the feature scale folded in."""
        return (self.draft.fc.weight / self.feature_scale[None, :]).detach()

    def load_drafter(self, path: Path) -> None:
        """Starts from a public-format checkpoint: its fc.weight acts on raw features, so the feature scale
        is multiplied back in (the inverse of fc_weight_for_checkpoint)."""
        self.draft.load_weights(load_file(str(path / "model.safetensors"), device=str(self.device)))
        with torch.no_grad():
            self.draft.fc.weight.mul_(self.feature_scale[None, :])
        self.draft.prepare_inference(self.device)

    def write_drafter(self, path: Path) -> None:
        """The drafter in the public checkpoint format (config.json + model.safetensors)."""
        self.draft.save_pretrained(path, overrides={"fc.weight": self.fc_weight_for_checkpoint()})

    # ---- one sequence ----
    def sequence_loss(self, ids: list[int], prompt_len: int, feats: torch.Tensor, anchors: torch.Tensor):
        block = self.cfg.block_size
        input_ids = torch.tensor(ids, device=self.device)
        anchors = anchors.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            feats = feats.float() / self.feature_scale
            h = draft_blocks_forward(self.draft, feats, input_ids, anchors, block, self.cfg.attention)
            h = self.draft.norm(h).view(len(anchors), block, -1)[:, 1:].flatten(0, 1)
            logits = F.linear(h, self.head.to(h.dtype)).view(len(anchors), block - 1, -1)  # 2-D GEMM, not bmm
        labels = block_labels(input_ids, anchors, block)
        if self.label_index is not None:
            labels = torch.where(labels >= 0, self.label_index[labels.clamp_min(0)], -100)
        return weighted_block_loss(logits, labels, self.weights), logits, labels

    def train_step(self) -> dict:
        cfg = self.cfg
        recs = self.next_batch()
        seqs = [self.sequence(r) for r in recs]
        feats = self.features(recs, [s for s, _ in seqs])
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        self.opt.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for (ids, plen), f in zip(seqs, feats):
            anchors = sample_anchors(plen, len(ids), cfg.anchors_per_seq, self.gen)
            if len(anchors) == 0:
                continue
            loss, _, _ = self.sequence_loss(ids, plen, f.clone(), anchors)
            (loss / len(seqs)).backward()
            total += loss.item()
            count += 1
            self.tokens_seen += len(ids)
        norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        lr = lr_at(self.step - 1, cfg)
        return {"step": self.step, "loss": total / max(count, 1), "grad_norm": float(norm), "lr": lr}

    # ---- evaluation ----
    @torch.no_grad()
    def eval_tau_teacher_forced(self) -> float:
        """Mean committed tokens per block (accepted drafts + 1) when drafting greedily from EVERY
        position of the dev greedy responses (cheap; a proxy for the real worker's tau)."""
        taus = []
        greedy = [r for r in self.dev if r["sampling"].get("temperature", 1.0) == 0] or self.dev
        seqs = [self.sequence(r) for r in greedy]
        for start in range(0, len(seqs), self.cfg.seqs_per_step):
            chunk = seqs[start : start + self.cfg.seqs_per_step]
            feats = self.features(greedy[start : start + self.cfg.seqs_per_step], [s for s, _ in chunk])
            for (ids, plen), f in zip(chunk, feats):
                if len(ids) - 1 <= plen:  # no response left within max_len
                    continue
                anchors = torch.arange(plen, len(ids) - 1, device=self.device)
                _, logits, labels = self.sequence_loss(ids, plen, f, anchors)
                hits = (logits.argmax(-1) == labels) & (labels >= 0)
                run = hits.long().cumprod(1).sum(1)
                taus.append(float((run + 1).float().mean()))
        return sum(taus) / len(taus) if taus else float("nan")

    def eval_tau_worker(self, checkpoint: Path) -> float:
        """Greedy tau of the real DFlashWorker (our Engine) with this checkpoint on dev prompts."""
        prompts = [r["prompt_ids"] for r in self.dev[: self.cfg.eval_worker_prompts]]
        return dev_tau(checkpoint, prompts, self.cfg.model_path, self.cfg.eval_max_new_tokens, self.cfg.device)

    # ---- checkpoints ----
    def save(self, tag: str = "latest") -> Path:
        path = self.out / tag
        self.write_drafter(path)
        if self.cache is not None:
            self.cache.flush()
        state = {"step": self.step, "opt": self.opt.state_dict(), "gen": self.gen.get_state(),
                 "fc_weight": self.draft.fc.weight.detach().cpu(), "feature_scale": self.feature_scale.cpu(),
                 "torch_rng": torch.get_rng_state(), "history": self.history, "tokens_seen": self.tokens_seen,
                 "order": self.order, "cursor": self.cursor, "epoch": self.epoch,
                 "dev": [r["id"] for r in self.dev], "config": asdict(self.cfg)}
        torch.save(state, path / "train_state.pt")
        return path

    def resume(self, path: Path) -> None:
        state = torch.load(path / "train_state.pt", weights_only=False)
        self.draft.load_weights(load_file(str(path / "model.safetensors"), device=str(self.device)))
        self.feature_scale = state["feature_scale"].to(self.device)
        with torch.no_grad():  # the exact trained weight (the file has the scale folded in)
            self.draft.fc.weight.copy_(state["fc_weight"])
        self.draft.prepare_inference(self.device)
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.history, self.tokens_seen = state["step"], state["history"], state["tokens_seen"]
        known = [i for i in state["order"] if i in self.records]  # the saved order, then records new since
        in_known = set(known)
        unseen = [i for i in self.order if i not in in_known]
        self.order, self.cursor, self.epoch = known + unseen, state["cursor"], state["epoch"]
        self.dev = [self.records[i] for i in state["dev"] if i in self.records]

    def evaluate(self, stats: dict, wall_s: float, log_path: Path | None) -> None:
        """Adds the dev-set taus to `stats`, appends it to the history (and the log file) and prints it."""
        stats["dev_tau_teacher_forced"] = self.eval_tau_teacher_forced()
        if self.cfg.eval_worker_prompts:
            self.write_drafter(self.out / "eval")
            stats["dev_tau"] = self.eval_tau_worker(self.out / "eval")
        stats.update(tokens_seen=self.tokens_seen, train_records=len(self.order), epoch=self.epoch,
                     wall_s=round(wall_s, 1))
        self.history.append(stats)
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(stats) + "\n")
        tqdm.write(json.dumps(stats))

    def run(self, max_steps: int | None = None, log_path: Path | None = None, reload=None) -> None:
        """Trains until total_steps (or max_steps more). `reload()` -> new records, called at checkpoints.
        A run started from a checkpoint (--init-from) first evaluates it: the curve's step 0."""
        cfg = self.cfg
        end = min(cfg.total_steps, self.step + max_steps) if max_steps else cfg.total_steps
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train", unit="step")
        t0, tok0 = time.perf_counter(), self.tokens_seen
        if self.step == 0 and cfg.init_from:
            self.evaluate({"step": 0, "init_from": cfg.init_from}, 0.0, log_path)
        while self.step < end:
            stats = self.train_step()
            bar.update(1)
            rate = (self.tokens_seen - tok0) / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{rate:.0f}", data=len(self.order))
            if self.step % cfg.eval_every == 0 or self.step == end:
                self.evaluate(stats, time.perf_counter() - t0, log_path)
            if self.step % cfg.ckpt_every == 0 or self.step == end:
                self.save()
                if reload is not None:
                    self.add_records(reload())
        bar.close()
