"""Old import paths of the modules that moved when the package was grouped by role.

``import ringcoll.zero``, ``from ringcoll.testing import spawn`` and ``python -m
ringcoll.model`` keep working: each old name is the very module object of its new home
(imported only when the old name is first used), not a copy, so ``isinstance`` and pickling
see one class. New code should use the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: old module name -> where it lives now
MOVED = {
    "ringcoll.cuda": "ringcoll.transports.cuda",
    "ringcoll.backend": "ringcoll.training.backend",
    "ringcoll.ddp": "ringcoll.training.ddp",
    "ringcoll.hierarchical": "ringcoll.training.hierarchical",
    "ringcoll.zero": "ringcoll.training.zero",
    "ringcoll.schedule": "ringcoll.learning.schedule",
    "ringcoll.trace": "ringcoll.learning.trace",
    "ringcoll.memory": "ringcoll.learning.memory",
    "ringcoll.model": "ringcoll.learning.model",
    "ringcoll.cli": "ringcoll.learning.cli",
    "ringcoll.testing": "ringcoll.harness.launcher",
    "ringcoll.bench": "ringcoll.harness.bench",
}


class _OldNameLoader(importlib.abc.Loader):
    def __init__(self, new_name: str):
        self.new_name = new_name
        self.new_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new_name)  # the module itself, under its old name too
        self.new_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed under its new name; the import system has just pointed its
        # __spec__ at the old name: point it back.
        module.__spec__ = self.new_spec

    def get_code(self, old_name: str):
        """For ``python -m <old name>``: run the new module's code as __main__."""
        return importlib.util.find_spec(self.new_name).loader.get_code(self.new_name)


class _OldNameFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _OldNameLoader(new_name))


def install() -> None:
    if not any(isinstance(f, _OldNameFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldNameFinder())
