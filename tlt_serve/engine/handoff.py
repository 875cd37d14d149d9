"""A tensor lent to another process on the same machine by reference, not by value.

The engine hands captured features to a co-located trainer this way: ``share`` turns a
tensor's memory into a handle (plain JSON: a CUDA IPC handle where it lives on a GPU, a named
shared-memory segment where it lives in host memory), ``open_shared`` maps it in the other
process. On a GPU the trainer then reads the features where the engine wrote them: no copy
to the host, no serialization, no upload.

The lender keeps the tensor alive until the borrower has opened it (``Lent``); the borrower
copies what it keeps (``open_shared`` returns a view of the lender's memory). CUDA orders
the lender's writes before the borrower's reads through the IPC event torch records when
sharing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch


def share(t: torch.Tensor) -> dict[str, Any]:
    """A handle to ``t`` (contiguous) that ``open_shared`` maps in another process of this
    machine. In host memory ``t``'s storage moves to shared memory first."""
    if not t.is_contiguous():
        raise ValueError("share: the tensor must be contiguous")
    storage = t.untyped_storage()
    ref: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "offset": t.storage_offset(),  # in elements
    }
    if t.device.type == "cuda":
        (device, handle, size, offset, counter, counter_offset, event,
         event_sync) = storage._share_cuda_()
        ref["cuda"] = {
            "device": int(device), "handle": handle.hex(), "size": int(size),
            "offset": int(offset), "counter": counter.hex(),
            "counter_offset": int(counter_offset), "event": event.hex(),
            "event_sync": bool(event_sync),
        }
    elif t.device.type == "cpu":
        manager, handle, size = storage._share_filename_cpu_()
        ref["cpu"] = {"manager": manager.hex(), "handle": handle.hex(), "size": int(size)}
    else:
        raise ValueError(f"share: tensors on {t.device.type} cannot be shared")
    return ref


def open_shared(ref: dict[str, Any]) -> torch.Tensor:
    """The tensor ``ref`` names (a view of the lender's memory: copy what you keep).
    ValueError when ``ref`` is malformed or its memory cannot be mapped here."""
    try:
        dtype = getattr(torch, str(ref["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {ref['dtype']!r}")
        shape = [int(n) for n in ref["shape"]]
        if "cuda" in ref:
            c = ref["cuda"]
            torch.cuda.init()
            storage = torch.UntypedStorage._new_shared_cuda(
                int(c["device"]), bytes.fromhex(c["handle"]), int(c["size"]), int(c["offset"]),
                bytes.fromhex(c["counter"]), int(c["counter_offset"]), bytes.fromhex(c["event"]),
                bool(c["event_sync"]))
            device = torch.device("cuda", int(c["device"]))
        else:
            c = ref["cpu"]
            storage = torch.UntypedStorage._new_shared_filename_cpu(
                bytes.fromhex(c["manager"]), bytes.fromhex(c["handle"]), int(c["size"]))
            device = torch.device("cpu")
        stride = torch.empty(shape, device="meta").stride()
        view = torch.empty(0, dtype=dtype, device=device)
        return view.set_(storage, int(ref["offset"]), shape, stride)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise ValueError(f"shared tensor cannot be opened here: {err!r}") from err


class Lent:
    """The tensors lent most recently, kept alive until their borrowers have opened them:
    a borrower asks again (and so has opened its last loan) before ``keep`` more go out."""

    def __init__(self, keep: int = 4) -> None:
        self._held: deque[torch.Tensor] = deque(maxlen=keep)

    def lend(self, t: torch.Tensor) -> dict[str, Any]:
        ref = share(t)
        self._held.append(t)
        return ref

    def __len__(self) -> int:
        return len(self._held)
