"""Until the default DFlash drafter ships: DFLASH with the default drafter falls back to plain decoding,
with a warning. Delete this module (and its one call in launch_server) once the drafter is installed."""

from __future__ import annotations

import dataclasses
import logging

from sglang_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)


def without_missing_default_drafter(args: ServerArgs) -> ServerArgs:
    from sglang_dflash.workers.dflash_worker import DEFAULT_DRAFTER

    if args.speculative_algorithm != "DFLASH" or args.speculative_draft_model_path:
        return args
    if (DEFAULT_DRAFTER / "model.safetensors").is_file():
        return args
    logger.warning(
        "the default DFlash drafter is not installed (%s): serving with plain autoregressive decoding; "
        "pass --speculative-draft-model-path to use a drafter", DEFAULT_DRAFTER,
    )
    return dataclasses.replace(
        args, speculative_algorithm=None, speculative_num_draft_tokens=None, speculative_dflash_block_size=None
    )
