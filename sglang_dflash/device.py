"""The one module that touches torch.cuda / torch.xpu: device resolution, sync, bf16 support, memory."""

import os
from types import ModuleType

import torch

ACCELERATORS = ("cuda", "xpu")
DeviceLike = torch.device | str


def _backend(device: DeviceLike) -> ModuleType | None:
    """torch.cuda / torch.xpu for accelerator devices, None for cpu."""
    kind = torch.device(device).type
    return torch.get_device_module(kind) if kind in ACCELERATORS else None


def is_available(kind: str) -> bool:
    return kind == "cpu" or (kind in ACCELERATORS and torch.get_device_module(kind).is_available())


def accelerator() -> torch.device | None:
    """The first available accelerator (cuda, then xpu), or None."""
    return next((torch.device(kind) for kind in ACCELERATORS if is_available(kind)), None)


def has_fast_bf16(device: DeviceLike) -> bool:
    """Whether bfloat16 matmuls run natively: on accelerators, and on CPUs with avx512_bf16 or AMX. Other
    CPUs emulate them (measured on an AVX-512 Xeon without either: 23 vs 116 GFLOPS float32, 1 thread)."""
    if torch.device(device).type != "cpu":
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:1', 'xpu', ... -> torch.device (with an index on accelerators)."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type not in ACCELERATORS:
        raise ValueError(f"unsupported device {name!r}: expected cpu, cuda or xpu")
    if not is_available(device.type):
        raise RuntimeError(
            f"device {name!r} requested but torch {torch.__version__} sees no {device.type} device"
        )
    backend = torch.get_device_module(device.type)
    index = backend.current_device() if device.index is None else device.index
    if index >= backend.device_count():
        raise RuntimeError(
            f"device {name!r} requested but only {backend.device_count()} {device.type} device(s)"
        )
    return torch.device(device.type, index)


def upload(data: list | torch.Tensor, dtype: torch.dtype, device: DeviceLike) -> torch.Tensor:
    """Host data (a list or a CPU tensor) on `device` without making the host wait: on an accelerator it is
    staged in pinned memory and copied non-blocking, in stream order (torch's caching host allocator keeps the
    staging buffer until the copy has run); on the CPU it is built in place. The one way host data reaches the
    device inside a step (the sync census counts every other upload)."""
    host = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor copied to host memory without waiting: pinned and non-blocking on an accelerator, an event
    recorded after the copy. `ready()` tells whether it landed (never blocks); `wait()` blocks until it has (the
    host-device sync point) and returns the host tensor. On the CPU the copy is a clone and always ready."""

    def __init__(self, tensor: torch.Tensor):
        backend = _backend(tensor.device)
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=backend is not None)
        self.host.copy_(tensor, non_blocking=True)
        self.host.is_host_copy = True  # the sync census does not count reads of it: it lives on the host
        self.event = None
        if backend is not None:
            self.event = backend.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def synchronize(device: DeviceLike) -> None:
    backend = _backend(device)
    if backend is not None:
        backend.synchronize(device)


def memory_info(device: DeviceLike) -> tuple[int, int]:
    """(free_bytes, total_bytes) of the device, or of host RAM for cpu."""
    backend = _backend(device)
    if backend is not None:
        free, total = backend.mem_get_info(device)
        return int(free), int(total)
    return _host_memory_info()


def _host_memory_info() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith("kB\n")}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def empty_cache(device: DeviceLike) -> None:
    backend = _backend(device)
    if backend is not None:
        backend.empty_cache()
