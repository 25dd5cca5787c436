"""The one warning autooffload raises, and a helper that raises each kind of it once.

It lives below every module that warns (the engines, the switch, the controller, the rank agreement), so
none of them has to import another to warn. Every warning means the same thing: autooffload fell back to
something safer, and training goes on. Each kind has a key; the message ends with the section of
``docs/troubleshooting.md`` that explains it (:data:`ANCHORS`; a test holds every key in the code to an anchor
that exists there).
"""

from __future__ import annotations

import warnings

TROUBLESHOOTING = "docs/troubleshooting.md"

# Warning key (the part before ":", for keys that name a module or a function) -> its section's anchor.
ANCHORS = {
    "no-targets": "no-targets",
    "no-probe": "no-probe",
    "probe-failed": "probe-failed",
    "probe-reset": "probe-reset",
    "probe-mark": "probe-mark",
    "probe-watch": "probe-watch",
    "simulated-peak": "simulated-peak",
    "no-tokens": "no-tokens",
    "container-calls": "container-calls",
    "container-silent": "container-silent",
    "stacks-apart": "stacks-apart",
    "stack-length": "stack-length",
    "keyword-input": "keyword-input",
    "checkpointing-off": "checkpointing-off",
    "unknown": "unknown",
    "offload-wrapper": "offload-wrapper",
    "deepspeed-config": "deepspeed-config",
    "policy": "policy",
    "policy-agreed": "policy-agreed",
    "policy-save": "policy-state",
    "policy-state": "policy-state",
    "keep-no-prediction": "keep-no-prediction",
    "keep-predict": "keep-no-prediction",
    "latched": "latched",
    "host-budget": "host-budget",
    "host-short": "host-short",
    "host-failed": "host-short",
    "pin-failed": "pin-failed",
    "history-write": "history-write",
    "history-dropped": "history-dropped",
    "ranks-without-layers": "ranks-without-layers",
    "peaked-delta": "peaked-delta",
    "rescue-off": "rescue-off",
    "failed": "internal-error",
    "rank-gave-up": "rank-gave-up",
    "uneven-micro-batches": "uneven-micro-batches",
    "axolotl-offloading": "axolotl-offloading",
    "trl-offloading": "trl-offloading",
}


class AutoOffloadWarning(UserWarning):
    """autooffload fell back to a safer behaviour; training goes on."""


def doc_link(key: str) -> str | None:
    """``docs/troubleshooting.md#<anchor>`` for a warning key, or None where no section explains it."""
    anchor = ANCHORS.get(key.split(":", 1)[0])
    return f"{TROUBLESHOOTING}#{anchor}" if anchor is not None else None


class WarnOnce:
    """Raises an :class:`AutoOffloadWarning` per key at most once: a fallback is news the first time only."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def __call__(self, key: str, message: str, stacklevel: int = 3) -> bool:
        """Warn ``message`` unless ``key`` warned before; True when it warned."""
        if key in self.keys:
            return False
        self.keys.add(key)
        link = doc_link(key)
        text = f"autooffload: {message}" + (f" (see {link})" if link else "")
        warnings.warn(text, AutoOffloadWarning, stacklevel=stacklevel)
        return True
