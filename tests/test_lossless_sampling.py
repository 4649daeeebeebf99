"""Sampling losslessness: on a tiny random target, the first 3 tokens sampled with DFLASH follow the exact
AR distribution (enumerated from the target's probabilities with the sampler's transforms); AR sampling
passes the same chi-square test, and deliberately wrong accept rules fail it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflash_helpers import device_engine, save_tiny_target, tiny_target_config
from safetensors.torch import load_file

import sglang_dflash.speculative.accept as accept_module
from sglang_dflash import Engine
from sglang_dflash.models.dflash import DFlashDraftModel, random_draft_model
from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.sampling.sampler import SamplingBatchInfo, logits_to_probs, sample_from_probs
from sglang_dflash.sampling.sampling_params import SamplingParams

VOCAB = 12
PROMPT = [1, 2, 3]
# every bigram (2, x) occurs in it and it ends with 2: whatever t1 is sampled, a context lookup matches
LOOKUP_PROMPT = [t for x in range(VOCAB) for t in (2, x)] + [2]
NUM_SAMPLES = 2000
BLOCK = 4
P_VALUE_PASS = 1e-3  # seeds are fixed, so every run is deterministic: no flakes, just a bound
P_VALUE_FAIL = 1e-8
SETTINGS = {
    "T1": {"temperature": 1.0},
    "T0.7-topp0.9-topk5": {"temperature": 0.7, "top_p": 0.9, "top_k": 5},
}


def exact_distribution(target_dir: Path, params: dict, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] from HF transformers' Llama on the same checkpoint (an independent forward),
    with the sampler's own temperature / top-k / top-p transform."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # every (t1, t2)
    seqs = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    with torch.no_grad():
        logits = model(seqs).logits[:, len(prompt) - 1 :].reshape(-1, VOCAB)  # rows predict t1, t2, t3
    info = SamplingBatchInfo.from_params([SamplingParams.from_dict(params)], VOCAB, torch.device("cpu"))
    probs = logits_to_probs(logits, info.expand(torch.tensor([len(logits)]), len(logits))).view(VOCAB, VOCAB, 3, VOCAB)
    p1 = probs[0, 0, 0]  # t1 depends on the prompt only
    p2 = probs[:, 0, 1]  # [t1, t2]
    p3 = probs[:, :, 2]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def likely_mask_token(target_dir: Path, exact: torch.Tensor) -> int:
    """A near-zero random drafter outputs about its input embedding, so it proposes argmax(lm_head(norm(
    embed[MASK]))) whatever the context. Pick the MASK whose proposal is the likeliest second token, so that
    drafts are accepted often enough to exercise the accept path as well as the rejection path."""
    weights = load_file(str(target_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    proposal = (F.rms_norm(embed, (embed.shape[1],)) @ weights["lm_head.weight"].T).argmax(-1)
    return int(exact.sum(dim=(0, 2))[proposal].argmax())


def save_tiny_setup(root: Path, make_draft: Callable[[DFlashConfig], DFlashDraftModel]) -> Path:
    """root/target: the tiny target; root/draft: the random drafter `make_draft` builds from its 1-layer draft
    config (whose mask token is `likely_mask_token`)."""
    cfg = tiny_target_config(VOCAB)
    save_tiny_target(root / "target", cfg, seed=0, std=0.25)
    mask = likely_mask_token(root / "target", exact_distribution(root / "target", SETTINGS["T1"]))
    make_draft(DFlashConfig.for_target(cfg, 1, BLOCK, mask_token_id=mask)).save_pretrained(root / "draft")
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_setup(tmp_path_factory.mktemp("tiny"), lambda cfg: random_draft_model(cfg, seed=0, std=0.02))


def engine_kwargs(tiny_dir: Path) -> dict:
    return dict(
        model_path=str(tiny_dir / "target"), dtype="float32", max_running_requests=NUM_SAMPLES,
        max_total_tokens=NUM_SAMPLES * 40, chunked_prefill_size=NUM_SAMPLES * len(LOOKUP_PROMPT),
    )


@pytest.fixture(scope="module")
def ar(tiny_dir: Path) -> Engine:
    return device_engine(**engine_kwargs(tiny_dir))


@pytest.fixture(scope="module")
def dflash(tiny_dir: Path) -> Engine:
    return device_engine(**engine_kwargs(tiny_dir), speculative_algorithm="DFLASH",
                         speculative_draft_model_path=str(tiny_dir / "draft"), speculative_adaptive=False,
                         speculative_lookup=False)


@pytest.fixture(scope="module")
def dflash_lookup(tiny_dir: Path) -> Engine:
    """Fixed blocks with context-lookup proposals mixed in (DFlash where no n-gram matches)."""
    return device_engine(**engine_kwargs(tiny_dir), speculative_algorithm="DFLASH",
                         speculative_draft_model_path=str(tiny_dir / "draft"), speculative_adaptive=False,
                         speculative_lookup=True)


def chi_square_p_value(samples: list[tuple[int, ...]], exact: torch.Tensor) -> float:
    """Goodness of fit of the sampled 3-token sequences; outcomes expected < 5 times are pooled."""
    counts = Counter(samples)
    flat = exact.flatten().double()
    observed = torch.zeros_like(flat)
    for (a, b, c), n in counts.items():
        observed[(a * VOCAB + b) * VOCAB + c] = n
    expected = flat * len(samples)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # an impossible sequence was sampled
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def sample_sequences(
    engine: Engine, params: dict, prompt: list[int] = PROMPT
) -> tuple[list[tuple[int, ...]], list[dict]]:
    sp = [dict(params, max_new_tokens=3, seed=i, ignore_eos=True) for i in range(NUM_SAMPLES)]
    outs = engine.generate(input_ids=[prompt] * NUM_SAMPLES, sampling_params=sp)
    assert all(len(o["output_ids"]) == 3 for o in outs)
    return [tuple(o["output_ids"]) for o in outs], [o["meta_info"] for o in outs]


@pytest.fixture(scope="module", params=list(SETTINGS), ids=list(SETTINGS))
def setting(request: pytest.FixtureRequest, tiny_dir: Path) -> tuple[dict, torch.Tensor]:
    params = SETTINGS[request.param]
    return params, exact_distribution(tiny_dir / "target", params)


def test_ar_sampling_matches_exact(ar: Engine, setting):
    params, exact = setting
    samples, _ = sample_sequences(ar, params)
    assert chi_square_p_value(samples, exact) > P_VALUE_PASS


def test_dflash_sampling_matches_exact(dflash: Engine, setting):
    params, exact = setting
    samples, metas = sample_sequences(dflash, params)
    hist = [sum(h) for h in zip(*(m["spec_accept_histogram"] for m in metas))]
    # both outcomes are well exercised: steps that reject at some slot and steps that accept drafts
    assert sum(hist[:-1]) > 0.1 * sum(hist) and sum(hist[1:]) > 0.1 * sum(hist), hist
    assert chi_square_p_value(samples, exact) > P_VALUE_PASS


def test_lookup_proposals_sampling_matches_exact(dflash_lookup: Engine, tiny_dir: Path):
    """A context-lookup proposal is a point mass like a DFlash draft: the same rejection rule stays exact."""
    params = SETTINGS["T1"]
    exact = exact_distribution(tiny_dir / "target", params, LOOKUP_PROMPT)
    samples, metas = sample_sequences(dflash_lookup, params, LOOKUP_PROMPT)
    lookup_steps = sum(m.get("spec_source_steps", {}).get("lookup", 0) for m in metas)
    assert lookup_steps > 0.3 * sum(m.get("spec_verify_ct", 0) for m in metas)
    hist = [sum(h) for h in zip(*(m["spec_accept_histogram"] for m in metas))]
    assert sum(hist[:-1]) > 0.1 * sum(hist) and sum(hist[1:]) > 0.1 * sum(hist), hist
    assert chi_square_p_value(samples, exact) > P_VALUE_PASS


def test_mixed_greedy_and_sampled_batch(dflash: Engine, ar: Engine, tiny_dir: Path):
    """A batch mixing greedy and sampled requests: the greedy ones give AR's greedy tokens, the sampled ones
    the exact distribution (the greedy rows are accepted by argmax, apart from the sampled ones)."""
    params = SETTINGS["T0.7-topp0.9-topk5"]
    greedy = [i % 4 == 0 for i in range(NUM_SAMPLES)]
    sp = [dict({"temperature": 0} if g else params, max_new_tokens=3, seed=i, ignore_eos=True)
          for i, g in enumerate(greedy)]
    outs = dflash.generate(input_ids=[PROMPT] * NUM_SAMPLES, sampling_params=sp)
    want = ar.generate(input_ids=[PROMPT], sampling_params={"temperature": 0, "max_new_tokens": 3,
                                                            "ignore_eos": True})[0]["output_ids"]
    assert all(o["output_ids"] == want for o, g in zip(outs, greedy) if g)
    samples = [tuple(o["output_ids"]) for o, g in zip(outs, greedy) if not g]
    assert chi_square_p_value(samples, exact_distribution(tiny_dir / "target", params)) > P_VALUE_PASS


def accept_everything(real):
    """Wrong rule: every draft the target gives nonzero probability is accepted (uniforms forced to 0)."""

    def wrong(target_probs, candidates, block_lens, uniforms, bonus_uniforms):
        return real(target_probs, candidates, block_lens, torch.zeros_like(uniforms), bonus_uniforms)

    return wrong


def no_residual(real):
    """Wrong rule: correct acceptance, but after a rejection the bonus is drawn from p itself, not from p
    with the rejected draft removed."""

    def wrong(target_probs, candidates, block_lens, uniforms, bonus_uniforms):
        accept_lens, _, out = real(target_probs, candidates, block_lens, uniforms, bonus_uniforms)
        rows = torch.arange(len(accept_lens))
        bonus = sample_from_probs(target_probs[rows, accept_lens], bonus_uniforms)
        out = out.clone()
        out[rows, accept_lens] = bonus
        return accept_lens, bonus, out

    return wrong


@pytest.mark.parametrize("rule", [accept_everything, no_residual])
def test_wrong_accept_rule_fails(dflash: Engine, setting, rule, monkeypatch: pytest.MonkeyPatch):
    params, exact = setting
    monkeypatch.setattr(accept_module, "sampling_accept", rule(accept_module.sampling_accept))
    samples, _ = sample_sequences(dflash, params)
    assert chi_square_p_value(samples, exact) < P_VALUE_FAIL
