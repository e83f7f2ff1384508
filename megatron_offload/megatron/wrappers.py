"""What ``attach_offloader`` put in place of megatron-core's methods and of the model configs' finalize functions,
with what was there before, so that the handle's ``detach()`` puts back exactly that, the latest first. The one
owner of that list; the finalize functions' own wrapping is finalize_prefetch.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_offload.megatron import finalize_prefetch

__all__ = ["Wrappers"]

FINALIZE = "finalize_model_grads_func"


class Wrappers:
    """The attributes the handle replaced, each with what was there before."""

    def __init__(self) -> None:
        self.model_chunks: list[Any] = []  # whose configs' finalize functions are wrapped (set at attach)
        self._wrapped: list[tuple[Any, str, Any]] = []  # (object, attribute, what was there before)

    def wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Put ``make(obj.<name>)`` in place of ``obj.<name>``."""
        before = vars(obj).get(name)
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name, before))

    def wrap_finalize_functions(self, handle: finalize_prefetch.Handle) -> None:
        """(Re)wrap each model config's finalize function (finalize_prefetch.py), each config noted once; after
        every step too, as training loops often set them after the optimizer is built."""
        for config in finalize_prefetch.wrap_finalize_functions(handle, self.model_chunks):
            if not any(obj is config for obj, _, _ in self._wrapped):
                self._wrapped.append((config, FINALIZE, None))

    def undo(self) -> None:
        """Put back what was there before every wrapper, the latest first. Safe to call twice."""
        for obj, name, before in reversed(self._wrapped):
            if name == FINALIZE:
                finalize_prefetch.unwrap_finalize_function(obj)
            elif before is None:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, before)
        self._wrapped.clear()
