"""`python -m sglang_dflash.launch_server` (or `sglang-dflash`): the OpenAI-compatible server, with SGLang's flags.

With no flags it serves the default model (SmolLM2-135M-Instruct) with DFLASH and the default drafter.
Unknown or conflicting flags exit with code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from pathlib import Path
from typing import NoReturn

from sglang_dflash.server_args import ServerArgs

DTYPE_ALIASES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                 "bf16": "bfloat16", "float": "float32", "float32": "float32"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr and exit code 2 (argparse prints the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def make_parser() -> ArgumentParser:
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    p = ArgumentParser(prog="sglang-dflash", description=__doc__.splitlines()[0], allow_abbrev=False)

    def add(flag: str, help: str, **kw) -> None:
        name = flag[2:].replace("-", "_")
        default = defaults.get(name)
        if default not in (None, False):
            help = f"{help} (default: {default})"
        p.add_argument(flag, default=None, help=help, **kw)

    add("--model-path", "HF directory or .gguf file of the target model (default: SmolLM2-135M-Instruct)")
    add("--tokenizer-path", "tokenizer directory (default: the model's)")
    add("--speculative-algorithm", "DFLASH or NONE (default: DFLASH for the default model or with a drafter path)",
        type=str.upper, choices=["DFLASH", "NONE"])
    add("--speculative-draft-model-path", "DFlash drafter checkpoint directory")
    add("--speculative-num-draft-tokens", "block size B of each verify step", type=int)
    add("--speculative-dflash-block-size", "alias of --speculative-num-draft-tokens (they must agree)", type=int)
    add("--speculative-adaptive", "choose each request's block size and proposer per step from measured "
        "acceptance and step cost (default: on)", action=argparse.BooleanOptionalAction)
    add("--speculative-lookup", "context-lookup proposals (the continuation of a repeated n-gram) beside DFlash "
        "(default: on)", action=argparse.BooleanOptionalAction)
    add("--speculative-lookup-min-match", "shortest suffix n-gram a lookup proposal matches", type=int)
    add("--speculative-lookup-max-match", "longest suffix n-gram a lookup proposal matches", type=int)
    add("--disable-overlap-schedule", "run the plain scheduler loop (the default on CPU)",
        action="store_const", const=True)
    add("--enable-overlap-schedule", "run the overlapped scheduler loop (the default on GPUs)",
        action="store_const", const=True)
    add("--enable-mixed-chunk", "a prefill step also decodes the running requests (one token each, no speculation), "
        "instead of stalling them", action="store_const", const=True)
    add("--enable-deterministic-inference", "bf16 on CPUs with AVX512-BF16: our batch-invariant linear kernel at "
        "every batch size, so a request's tokens do not depend on what else is batched with it (bf16 DFLASH equals "
        "AR token for token; slower on CPUs with AMX); elsewhere it changes nothing",
        action="store_const", const=True)
    add("--disable-radix-cache", "no radix prefix cache: every request prefills its whole prompt",
        action="store_const", const=True)
    add("--enable-cache-report", "report the prompt tokens served by the prefix cache in OpenAI responses "
        "(usage.prompt_tokens_details.cached_tokens)", action="store_const", const=True)
    add("--max-running-requests", "requests decoded together at most", type=int)
    add("--max-total-tokens", "KV cache slots (default: 32768 on cpu, else sized by --mem-fraction-static)",
        type=int)
    add("--mem-fraction-static", "share of device memory for weights and KV pools (default 0.85 on cuda/xpu; "
        "on cpu only when given, of host memory)", type=float)
    add("--chunked-prefill-size", "prompt tokens prefilled per step at most", type=int)
    add("--context-length", "context length (default: the model's)", type=int)
    add("--device", "device", choices=["cpu", "cuda", "xpu"])
    add("--dtype", "weights and KV dtype; auto = bfloat16", choices=sorted(DTYPE_ALIASES))
    add("--host", "address to bind")
    add("--port", "port to bind", type=int)
    add("--api-key", "require `Authorization: Bearer <key>` on every endpoint but /health")
    add("--served-model-name", "model id in the OpenAI API (default: the model path)")
    add("--log-level", "logging level", type=str.lower, choices=LOG_LEVELS)
    add("--random-seed", "seed for torch", type=int)
    add("--max-queued-requests", "requests that may wait beyond --max-running-requests; more get a 503 with "
        "Retry-After", type=int)
    add("--max-request-body-mb", "largest request body in MiB; a larger one gets a 413", type=float)
    add("--shutdown-grace-s", "on SIGTERM, seconds running requests get to finish before they are ended "
        "with an error", type=float)
    add("--request-timeout-s", "a request not finished this many seconds after it arrived (queueing included) is "
        "aborted with a 504 (default: no deadline)", type=float)
    return p


def default_speculative_algorithm(ns: argparse.Namespace) -> str:
    """DFLASH for the default model (it has a default drafter) or when a drafter is given, else NONE like SGLang."""
    return "DFLASH" if ns.model_path is None or ns.speculative_draft_model_path else "NONE"


def is_default_model(model_path: str | None) -> bool:
    from sglang_dflash.models.default_model import default_model_path

    if model_path is None:
        return True
    try:
        return Path(model_path).resolve() == default_model_path().resolve()
    except FileNotFoundError:
        return False


def as_flags(message: str) -> str:
    """ServerArgs messages name fields; the CLI user knows them as flags."""
    names = "|".join(f.name for f in dataclasses.fields(ServerArgs))
    return re.sub(rf"\b({names})\b", lambda m: "--" + m.group(1).replace("_", "-"), message)


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = make_parser()
    ns = parser.parse_args(argv)
    if ns.speculative_algorithm is None:
        ns.speculative_algorithm = default_speculative_algorithm(ns)
    if ns.dtype is not None:
        ns.dtype = DTYPE_ALIASES[ns.dtype]
    if ns.enable_overlap_schedule:
        if ns.disable_overlap_schedule:
            parser.error("--enable-overlap-schedule and --disable-overlap-schedule conflict")
        ns.disable_overlap_schedule = False
    del ns.enable_overlap_schedule
    given = {k: v for k, v in vars(ns).items() if v is not None}
    try:
        args = ServerArgs.from_kwargs(**given)
    except (TypeError, ValueError) as e:
        parser.error(as_flags(str(e)))
    if args.speculative_algorithm == "DFLASH" and not args.speculative_draft_model_path:
        if not is_default_model(args.model_path):
            parser.error("--speculative-algorithm DFLASH needs --speculative-draft-model-path for this --model-path")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    from sglang_dflash.entrypoints.http.http_server import build_app
    from sglang_dflash.entrypoints.http.lifecycle import serve

    try:
        app = build_app(args)
    except (ValueError, FileNotFoundError) as e:  # bad flag values found while loading (paths, drafter, sizes)
        make_parser().error(as_flags(str(e).splitlines()[0]))
    except KeyboardInterrupt:
        sys.exit(130)
    serve(app, args)


if __name__ == "__main__":
    main()
