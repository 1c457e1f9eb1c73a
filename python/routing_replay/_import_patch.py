"""Patching a module as it is imported: a finder that asks the other finders for the module and
wraps its loader, so that a patch runs right after the module's own code has (SGLang's capturer
module, vLLM's worker connector and its front end's modules). Each adapter subclasses the finder:
it finds its own finder in ``sys.meta_path`` by its class."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Optional


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules :meth:`patch_for` names with the other finders and patches each once it
    has run."""

    #: whether the finder leaves ``sys.meta_path`` once it has patched a module (one target)
    once = False

    def patch_for(self, fullname: str) -> Optional[Callable]:
        """The patch to run on module ``fullname`` once it has run, or None to leave it alone."""
        raise NotImplementedError

    def find_spec(self, fullname, path, target=None):
        patch = self.patch_for(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch, self if self.once else None)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """Runs the module as its own loader would, then patches it."""

    def __init__(self, loader, patch: Callable, finder: Optional[PatchOnImport]) -> None:
        self.loader = loader
        self.patch = patch
        self.finder = finder

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's own loader answers
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)
        if self.finder is not None and self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
