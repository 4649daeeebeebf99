"""Writes tests/fixtures/dflash2_tiny: a tiny random DFlash 2 draft checkpoint made by the REFERENCE
implementation (z-lab's `dflash==0.1.0`, `dflash.model.DFlash2DraftModel`), in the published format, plus the
reference's outputs on random inputs (reference.safetensors) for tests/test_dflash2.py.

    pip download --no-deps dflash==0.1.0 -d /tmp/dflash_pkg && unzip -q /tmp/dflash_pkg/*.whl -d /tmp/dflash_pkg/src
    python scripts/make_dflash2_fixture.py --reference-src /tmp/dflash_pkg/src

The reference runs on this environment's torch / transformers (it is imported from the unzipped wheel, not
installed). One sliding-window layer (window 3 < block 4, causal in the block by the reference's default) and
one full-attention layer; non-default input_embedding_scale, output_multiplier and final_logit_softcapping.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash2_tiny"
VOCAB, HIDDEN, BLOCK, MASK = 64, 32, 4, 5
CONTEXTS = (5, 3)  # two requests' committed lengths
TEMPERATURE = 0.7
DFLASH_CONFIG = {
    "target_layer_ids": [1, 2], "mask_token_id": MASK, "block_size": BLOCK, "conv_kernel_size": 3,
    "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6, "input_embedding_scale": 1.5,
    "output_multiplier": 0.8, "final_logit_softcapping": 20.0,
}


def reference_model(seed: int):
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=5000.0, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    cfg.num_target_layers = 4
    cfg.block_size = BLOCK
    cfg.dflash_config = dict(DFLASH_CONFIG)
    model = DFlash2DraftModel(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight random and far from trivial (the reference leaves base_kernel empty)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif "base_kernel" in name:
                p.copy_(0.5 * noise)
            elif "codebook" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def save_published(model, path: Path) -> None:
    """The reference's config.json, and its weights with the codebooks named as published (no `.weight`)."""
    model.save_pretrained(str(path), safe_serialization=True)
    weights = {k.removesuffix(".weight") if "codebook" in k else k: v.contiguous()
               for k, v in model.state_dict().items()}
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def reference_outputs(model, seed: int) -> dict[str, torch.Tensor]:
    """Per request r: context features, bonus, the normed block states of rows 1.., logits, the greedy path,
    a path sampled at TEMPERATURE with its candidates and q rows."""
    from dflash.model import DFlash2DraftModel

    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    out = {"embed": embed, "head": head.weight.detach().clone()}
    scale = DFLASH_CONFIG["input_embedding_scale"]
    torch.manual_seed(seed)
    for r, ctx in enumerate(CONTEXTS):
        features = torch.randn(1, ctx, 2 * HIDDEN, generator=g)
        bonus = torch.randint(VOCAB, (1,), generator=g)
        ids = torch.full((1, BLOCK), MASK)
        ids[0, 0] = bonus
        with torch.no_grad():
            hidden = model(target_hidden=features, noise_embedding=F.embedding(ids, embed) * scale,
                           position_ids=torch.arange(ctx + BLOCK)[None])[:, 1:]
            logits = DFlash2DraftModel.compute_logits(model, hidden, head)
            greedy, _, _ = model.propose(hidden, bonus, head, 0.0)
            sampled, candidates, q = model.propose(hidden, bonus, head, TEMPERATURE)
        out.update({f"{r}.features": features[0], f"{r}.bonus": bonus, f"{r}.hidden": hidden[0],
                    f"{r}.logits": logits[0], f"{r}.greedy": greedy[0], f"{r}.sampled": sampled[0],
                    f"{r}.candidates": candidates[0], f"{r}.q": q[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference-src", required=True, help="the unzipped dflash==0.1.0 wheel")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.reference_src)
    from dflash.model import DFlash2DraftModel

    model = reference_model(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    save_published(model, args.out)
    with tempfile.TemporaryDirectory() as tmp:  # the reference reads the published format back, identically
        for name in ("config.json", "model.safetensors"):
            shutil.copy(args.out / name, tmp)
        again = DFlash2DraftModel.from_pretrained(tmp, dtype=torch.float32)
        for k, v in model.state_dict().items():
            assert torch.equal(again.state_dict()[k], v), k
    save_file(reference_outputs(model, args.seed), str(args.out / "reference.safetensors"))
    sizes = {f.name: f.stat().st_size for f in args.out.iterdir()}
    print(json.dumps(sizes), sorted(load_file(str(args.out / "model.safetensors")))[:4])


if __name__ == "__main__":
    main()
