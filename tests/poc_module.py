"""Tests import a numbered PoC script (pocs/NN_name.py, not an importable module name) through this."""
import importlib.util
import sys
from pathlib import Path

POCS = Path(__file__).resolve().parent.parent / "pocs"


def load_poc(script: str, name: str, register: bool = False):
    """pocs/<script> executed as module `name`. register: put it in sys.modules first, where
    dataclasses and pickling look a module up (an earlier registration under that name is kept)."""
    spec = importlib.util.spec_from_file_location(name, POCS / script)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
