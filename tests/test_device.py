"""sglang_dflash.device: cpu paths everywhere, accelerator paths where one is present."""

from pathlib import Path

import pytest
import torch

from sglang_dflash import device as dev
from sglang_dflash.server_args import ServerArgs

ACCEL = dev.accelerator()


def test_resolve_device_cpu_and_errors() -> None:
    assert dev.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="expected cpu, cuda or xpu"):
        dev.resolve_device("meta")
    with pytest.raises(RuntimeError):
        dev.resolve_device("not-a-device")
    for kind in dev.ACCELERATORS:
        if not dev.is_available(kind):
            with pytest.raises(RuntimeError, match=f"no {kind} device"):
                dev.resolve_device(kind)


def test_accelerator_consistent() -> None:
    assert ACCEL is None or dev.is_available(ACCEL.type)
    assert dev.is_available("cpu") and not dev.is_available("meta")


def test_cpu_sync_and_cache_are_noops() -> None:
    cpu = torch.device("cpu")
    dev.synchronize(cpu)
    dev.empty_cache("cpu")
    assert dev.memory_info(cpu)[1] > 0


def test_cpu_memory_info(monkeypatch: pytest.MonkeyPatch) -> None:
    free, total = dev.memory_info("cpu")
    assert 0 < free <= total

    def no_proc(*args: object, **kwargs: object) -> None:
        raise OSError("no /proc")

    monkeypatch.setattr(dev, "open", no_proc, raising=False)
    free_sysconf, total_sysconf = dev.memory_info(torch.device("cpu"))
    assert 0 < free_sysconf <= total_sysconf and abs(total_sysconf - total) < 0.1 * total


@pytest.mark.skipif(ACCEL is None, reason="no cuda/xpu device")
def test_accelerator_roundtrip() -> None:
    device = dev.resolve_device(ACCEL.type)
    assert device.index is not None
    y = torch.ones(1024, device=device) * 2
    dev.synchronize(device)
    assert y.sum().item() == 2048
    dev.empty_cache(device)
    free, total = dev.memory_info(device)
    assert 0 < free <= total


def test_auto_dtype_is_bfloat16_only_where_it_is_native() -> None:
    """"auto" follows the CPU's own flags (read here from /proc/cpuinfo, independently of torch), and is
    bfloat16 on accelerators."""
    flags = Path("/proc/cpuinfo")
    if not flags.is_file():
        pytest.skip("no /proc/cpuinfo")
    native = bool({"avx512_bf16", "amx_bf16"} & set(flags.read_text().split()))
    assert ServerArgs(dtype="auto").torch_dtype == (torch.bfloat16 if native else torch.float32)
    assert ServerArgs(device="cuda", dtype="auto").torch_dtype == torch.bfloat16
    assert ServerArgs(dtype="float32").torch_dtype == torch.float32
