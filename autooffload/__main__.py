"""``python -m autooffload`` / ``autooffload``: the command line (``demo``, ``estimate``, ``plot``).

Only the command that runs is imported: ``--help``, ``--version`` and ``estimate`` load no torch."""

from __future__ import annotations

import sys

# Each command's one line for the usage, written here so that --help need not import the command (demo imports torch).
COMMANDS = {
    "demo": "train a tiny random Qwen3 on mixed lengths and show each decision (CPU, under a minute)",
    "estimate": "what offload would free and cost for a model and a sequence length (arithmetic, no torch)",
    "plot": "draw a training's history file: what the controller decided and why",
}
USAGE = (
    f"usage: autooffload {{{','.join(COMMANDS)}}} [options]   (autooffload COMMAND --help for its options)\n"
    "       autooffload --version\n\n" + "\n".join(f"  {name:<9} {line}" for name, line in COMMANDS.items())
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"autooffload {__version__}")
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        from .settings import shown

        print(
            f"autooffload: error: unknown command {shown(argv[0])}: expected one of {', '.join(COMMANDS)} "
            "(autooffload --help)",
            file=sys.stderr,
        )
        return 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as run
    elif command == "plot":
        from .plot import main as run
    else:
        from .estimate import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
