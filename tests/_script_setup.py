"""Imported by the kernel test files when they run as scripts (``python tests/test_x.py compile-sm90 |
gpu | bench``; Python puts ``tests/`` first on sys.path then): import this checkout, not an installed
copy, and on a bare GPU machine without torchtitan skip the package's registration imports (the
kernels need none of it)."""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:
    import torchtitan  # noqa: F401
except ImportError:
    for _name in ("titan_megamoe", "titan_megamoe.ops"):
        _mod = types.ModuleType(_name)
        _mod.__path__ = [str(ROOT.joinpath(*_name.split(".")))]
        sys.modules[_name] = _mod
