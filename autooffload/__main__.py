"""``python -m autooffload`` / ``autooffload``: the command line (``demo``, ``estimate``, ``plot``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("demo", "estimate", "plot")
    usage = (
        f"usage: autooffload {{{','.join(commands)}}} [options]   (autooffload COMMAND --help for its options)\n"
        "       autooffload --version"
    )
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"autooffload {__version__}")
        return 0
    if not argv or argv[0] not in commands:
        print(usage, file=sys.stderr)
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
