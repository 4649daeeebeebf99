"""Dev-set tau of a draft checkpoint measured with the real DFlashWorker (our Engine, greedy, one batch)."""

from __future__ import annotations

from pathlib import Path

from sglang_dflash.entrypoints.engine import Engine


def dev_tau(
    checkpoint: Path, prompts: list[list[int]], model_path: str | None, max_new_tokens: int, device: str = "cpu"
) -> float:
    """Mean over prompts of the committed tokens per verify step (bonus included), as the DFlash paper's tau."""
    if not prompts:
        return float("nan")
    longest = max(map(len, prompts)) + max_new_tokens
    engine = Engine(
        model_path=model_path, device=device, dtype="auto", speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(checkpoint), max_running_requests=len(prompts),
        max_total_tokens=len(prompts) * (longest + 64), disable_overlap_schedule=True,
    )
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    taus = [o["meta_info"].get("spec_accept_length", 1.0) for o in outs]
    return sum(taus) / len(taus)
