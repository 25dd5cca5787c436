"""Line-level fault injection: an exception at every line of ``autooffload/`` that a short training run executes
(``python -m benchmarks.line_faults``; ``__main__`` says what it checks). Modules, importing downwards only:
``tracing`` (the trace function) < ``training`` (one Trainer run in a child) < ``forking`` (the warm parent) <
``report`` (results.md) < ``__main__`` (the settings, the checks, the loop)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout, not an installed autooffload
