"""The package this checkout holds, ahead of the one the venv installed: the venv installs
the checkout that ran `make install` in editable mode, so without this a bench run from
another checkout (a `git worktree` of the code before a change) would measure that one's
code in process. Every bench module that imports `servicer` imports this first."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)
