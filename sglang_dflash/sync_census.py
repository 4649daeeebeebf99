"""SyncCensus: counts the operations in a block of code that make the host wait for the device.

On a GPU each one drains the stream: the host cannot prepare step N + 1 while step N runs. On any device (the
CPU included, where nothing waits) they are found by instrumentation: reads of tensor values on the host
(`item`, `tolist`, `numpy`, `bool(t)` / `int(t)`, copies to the CPU), ops whose output shape depends on the
data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`),
uploads of host data (`torch.tensor` / `torch.as_tensor` of Python lists or numbers, and on an accelerator any
blocking copy from host memory: a copy from pageable memory waits for the stream), blocking copies to the host,
and waits for a `device.HostCopy`. Not counted: `device.upload` (pinned, non-blocking, stream-ordered) and reads
of a HostCopy's host tensor (it lives on the host; its `wait` is the sync point, counted).
Each is recorded with the first frame of the caller inside this package, so a census says where they are.

    with SyncCensus() as census:
        scheduler.run_step()
    census.count, census.by_site()
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_dflash import device

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the checkout: sglang_dflash/, scheduler/, kernels/
TORCH_ROOT = Path(torch.__file__).resolve().parent
aten = torch.ops.aten
DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "item",  # item(), bool(t), int(t), float(t)
    aten.nonzero.default: "nonzero",
    aten.argwhere.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",  # its output_size argument makes it sync-free
    aten.repeat_interleave.self_Tensor: "repeat_interleave",
}
HOST_READS = ("tolist", "numpy")  # Tensor methods that read values on the host without dispatching on CPU
UPLOADS = ("tensor", "as_tensor")  # torch functions that build a tensor from host data
NON_BLOCKING = {("device.py", "upload")}  # the sanctioned upload: pinned and non-blocking on an accelerator


class SyncCensus(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, str]] = []  # (kind, "file:line in function") per blocking operation
        self._saved: list[tuple[object, str, object]] = []  # (owner, attribute, original) of each patch

    @property
    def count(self) -> int:
        return len(self.sites)

    def by_site(self) -> Counter:
        return Counter(self.sites)

    def record(self, kind: str) -> None:
        stack = [f for f in traceback.extract_stack() if TORCH_ROOT not in Path(f.filename).resolve().parents
                 and Path(f.filename).name != "sync_census.py"]
        ours = [f for f in stack if _inside_package(f.filename)]
        where = (ours or stack)[-1]
        if (Path(where.filename).name, where.name) in NON_BLOCKING:
            return
        self.sites.append((kind, f"{Path(where.filename).name}:{where.lineno} {where.name}"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = DATA_DEPENDENT.get(func)
        if kind == "repeat_interleave" and kwargs.get("output_size") is not None:
            kind = None
        if kind is None and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                kind = "bool-mask index"
        if kind is None and func in (aten._to_copy.default, aten.copy_.default):
            kind = _blocking_copy(func, args, kwargs)
        if kind is not None:
            self.record(kind)
        return func(*args, **kwargs)

    def __enter__(self) -> SyncCensus:
        for name in HOST_READS:
            method = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, method))

            def counted(t, *a, _name=name, _method=method, **k):
                if not getattr(t, "is_host_copy", False):
                    self.record(_name)
                return _method(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        for name in UPLOADS:
            build = getattr(torch, name)
            self._saved.append((torch, name, build))

            def uploaded(data, *a, _build=build, **k):
                if not isinstance(data, torch.Tensor):
                    self.record("upload")
                return _build(data, *a, **k)

            setattr(torch, name, uploaded)
        wait = device.HostCopy.wait
        self._saved.append((device.HostCopy, "wait", wait))

        def waited(copy, _wait=wait):
            self.record("wait")
            return _wait(copy)

        device.HostCopy.wait = waited
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for owner, attr, saved in self._saved:
            setattr(owner, attr, saved)
        self._saved.clear()


def _blocking_copy(func, args, kwargs) -> str | None:
    """'copy to host' for a copy from an accelerator into host memory unless it is non-blocking into pinned
    memory; 'upload' for a blocking copy from host memory to an accelerator."""
    if func is aten._to_copy.default:
        src, dst, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
        pinned = bool(kwargs.get("pin_memory"))
    else:
        dst, src = args[0].device, args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        pinned = args[0].is_pinned() if dst.type == "cpu" else False
    if dst is None or src.device.type == dst.type:
        return None
    if dst.type == "cpu":
        return None if non_blocking and pinned else "copy to host"
    return None if non_blocking else "upload"


def _inside_package(filename: str) -> bool:
    """Whether a frame is in the package's code (sglang_dflash/, scheduler/, kernels/), this module aside."""
    path = Path(filename).resolve()
    if PACKAGE_ROOT not in path.parents or path.name == "sync_census.py":
        return False
    return path.relative_to(PACKAGE_ROOT).parts[0] in ("sglang_dflash", "scheduler", "kernels")
