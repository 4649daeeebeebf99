"""Which implementation `--speculative-algorithm DFLASH` gets, and the registered algorithm's server-args policy.

SGLang's own DFLASH refuses CPUs at argument resolution. A resolution step wrapped around
`handle_speculative_decoding` renames DFLASH to our registered algorithm before SGLang validates it,
so every later stage (validation, scheduler, worker factory) sees our algorithm.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
from sglang.srt.speculative.spec_info import CustomSpecAlgo

from sglang_dflash.models.dflash_config import DFlashConfig
from sglang_dflash.speculative.drafter import merge_block_flags, resolve_block_size
from sglang_dflash.speculative.policy import SpecOptions

logger = logging.getLogger(__name__)

ALGORITHM = "SGLANG_DFLASH"  # registered name; DFLASH is routed to it
IMPL_ENV = "SGLANG_DFLASH_IMPL"  # "sglang_dflash" (ours) or "sglang" (SGLang's built-in)
IMPLS = ("sglang_dflash", "sglang")
LOOKUP_ENV = "SGLANG_DFLASH_LOOKUP"  # "0" turns context-lookup proposals off (they need --disable-overlap-schedule)
DEFAULT_MAX_RUNNING_REQUESTS = 48  # as SGLang's DFLASH


def our_impl_selected(device: str | None) -> bool:
    """Ours on CPU unless SGLANG_DFLASH_IMPL=sglang; elsewhere only with SGLANG_DFLASH_IMPL=sglang_dflash."""
    impl = os.environ.get(IMPL_ENV, "").strip().lower()
    if impl and impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r}: expected one of {IMPLS}")
    if impl:
        return impl == "sglang_dflash"
    return (device or "").startswith("cpu")


def route_dflash(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution step around `handle_speculative_decoding`: DFLASH -> ALGORITHM when ours is selected."""
    cfg = resolving_view(server_args)
    if (cfg.speculative_algorithm or "").upper() != "DFLASH" or not our_impl_selected(cfg.device):
        previous(server_args)
        return
    declare_resolution(server_args, "sglang_dflash.route_dflash", speculative_algorithm=ALGORITHM)
    previous(server_args)
    resolved = resolving_view(server_args).speculative_algorithm
    if resolved != ALGORITHM:
        raise RuntimeError(f"sglang_dflash: DFLASH resolved to {resolved!r}, not {ALGORITHM!r}; routing failed")
    logger.info("sglang_dflash: --speculative-algorithm DFLASH on %r runs %s", cfg.device, ALGORITHM)


def spec_options(block_size: int, adaptive: bool) -> SpecOptions:
    """The proposer options of the plugin: SGLang has no flags for them, so they come from the environment."""
    lookup = os.environ.get(LOOKUP_ENV, "1").strip().lower() not in ("0", "false", "off", "no")
    return SpecOptions(block_size, adaptive=adaptive, lookup=lookup)


def drafter_dir(path: str) -> Path:
    """A local DFlash checkpoint directory, downloading a Hugging Face repo id if needed."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))


class DFlashSpecAlgo(CustomSpecAlgo):
    """The registered algorithm: chain verify of B tokens, one draft step, no relayed top-k or hidden states."""

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(
        self, device: torch.device, req_to_token_pool: Any, needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def handle_server_args(self, server_args: Any) -> None:
        """Block size B from --speculative-num-draft-tokens / --speculative-dflash-block-size / the drafter;
        writes go through SGLang's recording stand-in and become declared resolutions."""
        path = server_args.speculative_draft_model_path
        if path is None:
            raise ValueError("DFLASH speculative decoding requires --speculative-draft-model-path")
        if server_args.pp_size != 1:
            raise ValueError("sglang_dflash's DFLASH worker supports pp_size == 1 only")
        drafter_block = DFlashConfig.load(drafter_dir(path)).block_size
        requested = merge_block_flags(
            server_args.speculative_num_draft_tokens, server_args.speculative_dflash_block_size
        )
        size = resolve_block_size(requested, drafter_block)
        server_args.speculative_num_steps = 1
        server_args.speculative_eagle_topk = 1
        server_args.speculative_num_draft_tokens = size
        if server_args.max_running_requests is None:
            server_args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        if not str(server_args.device).startswith("cpu") and not server_args.disable_cuda_graph:
            # SGLang's graph runner captures verify without hidden states for algorithms outside its DFlash
            # family, which this worker needs: it runs eager on GPUs
            server_args.disable_cuda_graph = True
            logger.warning("sglang_dflash: CUDA graphs disabled for %s (the worker runs eager)", ALGORITHM)
