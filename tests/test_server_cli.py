"""launch_server CLI: SGLang flag names and defaults, one-line errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sglang_dflash.launch_server import parse_args


def test_unknown_flag_exits_2_with_one_line() -> None:
    cmd = [sys.executable, "-m", "sglang_dflash.launch_server", "--no-such-flag"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "sglang-dflash: error: unrecognized arguments: --no-such-flag (see --help)"


def test_bad_port_exits_2_before_loading_the_model() -> None:
    cmd = [sys.executable, "-m", "sglang_dflash.launch_server", "--port", "99999"]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "sglang-dflash: error: --port must be in [1, 65535], got 99999 (see --help)"
    assert time.perf_counter() - start < 30  # the flags are checked before anything is loaded


@pytest.mark.parametrize(
    "args, message",
    [
        (["--speculative-num-draft-tokens", "8", "--speculative-dflash-block-size", "4"],
         "--speculative-num-draft-tokens (8) and --speculative-dflash-block-size (4) disagree"),
        (["--speculative-algorithm", "NONE", "--speculative-num-draft-tokens", "4"], "need --speculative-algorithm"),
        (["--max-total-tokens", "0"], "--max-total-tokens must be >= 1"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--model-path", "other.gguf", "--speculative-algorithm", "DFLASH"], "needs --speculative-draft-model-path"),
        (["--port", "99999"], "--port must be in [1, 65535]"),
        (["--port", "0"], "--port must be in [1, 65535]"),
        (["--port", "http"], "invalid int value: 'http'"),
        (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
        (["--max-request-body-mb", "0"], "--max-request-body-mb must be in (0, 1024]"),
        (["--max-request-body-mb", "nan"], "--max-request-body-mb must be in (0, 1024]"),
        (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be in [0, 3600]"),
        (["--context-length", "0"], "--context-length must be >= 2"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1)"),
    ],
)
def test_conflicting_flags_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang-dflash: error: ") and message in lines[0], lines


def test_defaults_match_sglang() -> None:
    args = parse_args([])
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    assert args.model_path is None and args.speculative_algorithm == "DFLASH"
    assert args.disable_overlap_schedule == (args.device == "cpu") and args.api_key is None  # plain loop on CPU
    assert (args.max_running_requests, args.max_queued_requests) == (32, 256)
    assert args.max_total_tokens is None and args.mem_fraction_static is None  # 32768 on cpu, else 0.85 of memory
    assert (args.max_request_body_mb, args.shutdown_grace_s) == (8, 10)


def test_flags_map_to_server_args() -> None:
    args = parse_args([
        "--model-path", "m.gguf", "--speculative-algorithm", "dflash", "--speculative-draft-model-path", "d",
        "--speculative-dflash-block-size", "8", "--disable-overlap-schedule", "--max-running-requests", "4",
        "--max-total-tokens", "1000", "--chunked-prefill-size", "64", "--context-length", "512", "--device", "cpu",
        "--dtype", "half", "--host", "0.0.0.0", "--port", "8000", "--api-key", "k", "--served-model-name", "x",
        "--log-level", "DEBUG", "--mem-fraction-static", "0.7",
    ])
    assert args.speculative_algorithm == "DFLASH" and args.speculative_num_draft_tokens == 8
    assert args.disable_overlap_schedule and args.dtype == "float16" and args.log_level == "debug"
    assert (args.max_running_requests, args.max_total_tokens, args.chunked_prefill_size) == (4, 1000, 64)
    assert args.mem_fraction_static == 0.7
    assert (args.context_length, args.host, args.port, args.api_key, args.served_model_name) == (
        512, "0.0.0.0", 8000, "k", "x"
    )


def test_other_models_default_to_plain_decoding() -> None:
    assert parse_args(["--model-path", "other.gguf"]).speculative_algorithm is None


def test_default_model_serves_dflash_with_the_shipped_drafter() -> None:
    from sglang_dflash.models.dflash_config import DFlashConfig
    from sglang_dflash.speculative.drafter import DEFAULT_DRAFTER, default_drafter_path

    assert parse_args([]).speculative_algorithm == "DFLASH"
    assert default_drafter_path(None) == DEFAULT_DRAFTER
    cfg = DFlashConfig.load(DEFAULT_DRAFTER)
    assert cfg.block_size == 16 and (DEFAULT_DRAFTER / "model.safetensors").stat().st_size <= 40 * 2**20
