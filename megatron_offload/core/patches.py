"""Hooks and methods put on object instances (never on their classes), kept so that all of them can be taken
off again: what every attach does to a model or an optimizer, and what its ``detach`` undoes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["InstancePatches"]


@dataclass
class InstancePatches:
    """The hook handles registered and the ``(object, name)`` of each method set on an instance."""

    hooks: list[Any] = field(default_factory=list)
    replaced: list[tuple[Any, str]] = field(default_factory=list)

    def hook(self, handle: Any) -> None:
        """Keep a ``RemovableHandle`` (``register_*_hook``'s answer) to remove at ``undo``."""
        self.hooks.append(handle)

    def replace(self, obj: Any, name: str, method: Callable[..., Any]) -> None:
        """Set ``method`` as ``obj.name`` on the instance: the class and other instances are untouched."""
        setattr(obj, name, method)
        self.replaced.append((obj, name))

    def wrap(self, obj: Any, name: str, around: Callable[..., Any]) -> None:
        """``obj.name(*args, **kwargs)`` becomes ``around(original, *args, **kwargs)``."""
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(original, *args, **kwargs)

        self.replace(obj, name, wrapper)

    def call_before(self, obj: Any, name: str, before: Callable[[], None]) -> None:
        """``before()`` runs ahead of every call of ``obj.name``."""

        def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            before()
            return original(*args, **kwargs)

        self.wrap(obj, name, around)

    def undo(self) -> None:
        """Remove every hook and drop every instance method: the class's own shows through again."""
        for handle in self.hooks:
            handle.remove()
        for obj, name in reversed(self.replaced):
            vars(obj).pop(name, None)
        self.hooks, self.replaced = [], []
