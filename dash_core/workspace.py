"""What the prefill calls of one batch share: the plan, the routing scratch and the launches, made once.

Every layer of an engine step prefills the same batch: the same ``cu_seqlens_q`` and ``seq_lens``,
the same shapes. Without a workspace each call builds its plan (shape arithmetic and the launch that
writes the tile tables), allocates its routing scratch and prepares its launches' arguments again. Pass
one ``PrefillWorkspace`` to all of a batch's ``ops.paged_dash_prefill`` calls (FlashInfer's plan/run
split, made implicit): the first call builds and keeps them, the calls after it reuse them. The op's
validation of the step's tables (block table, lengths, slot mapping) is kept alike: the first call
checks them, the others check only their own inputs (queries, keys, values, cache, output).

A workspace serves one batch. It rebuilds when a call differs from the one that built it in shapes,
parameters, device or the length tensors themselves (compared by identity; the workspace holds them,
so their memory cannot be reused by other tensors meanwhile). Values written into those same tensors
in place are not seen: make a new workspace for a new batch. The calls must run on one stream (the
layers of a step do), since they share the scratch. The PyTorch path (CPU, fp32) ignores it.

Example (what a second call with the same batch reuses)::

    >>> ws = PrefillWorkspace()
    >>> cu, lens = object(), object()
    >>> ws.take(("shape",), (cu, lens), lambda: "plan")
    'plan'
    >>> ws.take(("shape",), (cu, lens), lambda: "never made"), ws.builds
    ('plan', 1)
    >>> ws.take(("other shape",), (cu, lens), lambda: "plan 2"), ws.builds
    ('plan 2', 2)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

from .kernels.prefill.config import PrefillConfig
from .layout import same_objects


_RESERVED: Dict[torch.device, torch.Tensor] = {}  # the scratch a memory profile holds, per device


def reserve_prefill_scratch(nbytes: int, device: torch.device) -> None:
    """Hold ``nbytes`` on a CUDA ``device`` until ``release_prefill_scratch`` (nothing elsewhere, nothing while a
    graph is captured; one reservation per device, the largest asked for). A memory profile of the running step
    then counts, from the first layer on, the prefill scratch that a step's workspace holds as long."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        _hold(nbytes, device)


def release_prefill_scratch() -> None:
    """Free what ``reserve_prefill_scratch`` holds."""
    _RESERVED.clear()


def _hold(nbytes: int, device: torch.device) -> None:
    held = _RESERVED.get(device)
    if held is None or held.numel() < nbytes:
        _RESERVED.pop(device, None)
        _RESERVED[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)


def check_workspace(workspace: Any) -> None:
    """A ``workspace`` argument: None or a ``PrefillWorkspace`` (TypeError otherwise)."""
    if workspace is not None and not isinstance(workspace, PrefillWorkspace):
        raise TypeError(f"workspace must be a dash_core.workspace.PrefillWorkspace, got {type(workspace).__name__}")


class PrefillWorkspace:
    """The plan, scratch and launches of one batch's prefill calls (see the module docstring).

    config: the prefill launches' tuning (``dash_core.kernels.prefill.config.PrefillConfig``; None: the defaults
    of the device's architecture). builds: how many times a call had to make them (1 when every call of the batch
    reused them).
    """

    def __init__(self, config: Optional[PrefillConfig] = None) -> None:
        if config is not None and not isinstance(config, PrefillConfig):
            raise TypeError(f"config must be a PrefillConfig or None, got {type(config).__name__}")
        self.config = config
        self._key: Optional[Hashable] = None
        self._lens: Tuple[Any, ...] = ()
        self._value: Any = None
        self._checked: Optional[tuple] = None  # (key, the step's tables) that passed their checks (checked)
        self.builds = 0

    def take(self, key: Hashable, lens: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The kept value when ``key`` equals the kept key and ``lens`` are the very objects kept with it;
        else ``make()``, kept with ``key`` and ``lens`` (the objects, held)."""
        if self.builds == 0 or key != self._key or not same_objects(lens, self._lens):
            self._value = make()
            self._key, self._lens = key, tuple(lens)
            self.builds += 1
        return self._value

    def checked(self, key: Hashable, tables: Tuple[Any, ...], check: Callable[[], None]) -> None:
        """Run ``check()`` (the validation of a step's tables, which raises on bad ones) unless it passed for
        ``key`` with these very ``tables`` at the last call that ran it (the objects, held until the next)."""
        last = self._checked
        if last is None or last[0] != key or not same_objects(last[1], tables):
            self._checked = None
            check()
            self._checked = (key, tuple(tables))

    def clear(self) -> None:
        """Drop the kept plan, scratch and launches (their memory returns to the allocator)."""
        self._key, self._lens, self._value, self._checked = None, (), None, None
