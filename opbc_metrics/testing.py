"""Test utilities for users and for this library: a detector of host-device syncs.

``update()`` must never stall the GPU: no ``.item()``, ``.tolist()``, ``bool(tensor)`` and no operator
whose output shape depends on the data (``nonzero``, boolean indexing, ``unique``, ...). On CPU these
are invisible, so :func:`assert_no_host_sync` watches the operators dispatched inside a block and
fails on any of them, whatever the device. Where CUDA is in use it also runs the block under CUDA's sync
debug mode, which catches what the dispatcher does not show: a blocking copy of host data to the device
(``torch.tensor(list, device="cuda")``) waits for every kernel queued before it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that copy a value to the host or whose output shape depends on tensor values.
HOST_SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::allclose",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::argwhere",
        "aten::masked_select",
        "aten::masked_scatter",
        "aten::unique",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::bincount",
        "aten::repeat_interleave",
        "aten::_assert_async",
    }
)


class HostSyncError(AssertionError):
    """Raised when an operator that forces a host-device sync runs inside :func:`assert_no_host_sync`."""


class _SyncDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_SYNC_OPS:
            raise HostSyncError(f"host-device sync or data-dependent shape: {func}")
        if name == "aten::histc":
            # histc sizes its output from `bins`; only min == max makes it read the data's range.
            lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
            hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
            if lo == hi:
                raise HostSyncError("histc without an explicit range reads min/max to the host")
        if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for idx in indices or ():
                if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                    raise HostSyncError(f"boolean-mask indexing (data-dependent shape) in {func}")
        return func(*args, **kwargs)


@contextmanager
def assert_no_host_sync() -> Iterator[None]:
    """Fail with :class:`HostSyncError` if the block dispatches a host-syncing operator.

    Example:
        >>> import torch
        >>> x = torch.arange(4.0)
        >>> with assert_no_host_sync():
        ...     y = (x * 2).sum()
        >>> with assert_no_host_sync():
        ...     x.sum().item()
        Traceback (most recent call last):
        ...
        opbc_metrics.testing.HostSyncError: host-device sync or data-dependent shape: aten._local_scalar_dense.default
    """
    # tolist() and numpy() read memory directly, below the dispatcher: patch them for the block.
    def refuse(name: str) -> Any:
        def method(*_: Any, **__: Any) -> Any:
            raise HostSyncError(f"host-device sync: Tensor.{name}()")

        return method

    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")}
    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse(name))
        with _cuda_sync_watch(), _SyncDetector():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@contextmanager
def _cuda_sync_watch() -> Iterator[None]:
    """Fail if the block calls a synchronizing CUDA operation, naming every line of Python that did."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # a warning per sync, raised at the calling Python line
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchronizing CUDA operation" in str(w.message)})
    for w in caught:
        if "synchronizing CUDA operation" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if syncs:
        raise HostSyncError(f"synchronizing CUDA operation(s) at {', '.join(syncs)}")
