"""The one warning autooffload raises, and a helper that raises each kind of it once.

It lives below every module that warns (the engines, the switch, the controller, the rank agreement), so
none of them has to import another to warn. Every warning means the same thing: autooffload fell back to
something safer, and training goes on.
"""

from __future__ import annotations

import warnings


class AutoOffloadWarning(UserWarning):
    """autooffload fell back to a safer behaviour; training goes on."""


class WarnOnce:
    """Raises an :class:`AutoOffloadWarning` per key at most once: a fallback is news the first time only."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def __call__(self, key: str, message: str, stacklevel: int = 3) -> bool:
        """Warn ``message`` unless ``key`` warned before; True when it warned."""
        if key in self.keys:
            return False
        self.keys.add(key)
        warnings.warn(f"autooffload: {message}", AutoOffloadWarning, stacklevel=stacklevel)
        return True
