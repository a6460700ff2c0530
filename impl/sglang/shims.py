"""Import shims for SGLang's scheduler-side objects on a CPU-only machine.

SGLang imports some GPU or vision packages unconditionally on the path to its
scheduler and memory pools, though the objects kvcheck drives never call them.
Each shim below names the package, why it is absent, and what the stub does:
attribute access yields a placeholder; calling or instantiating one raises, so
a code path that really needs the package fails loudly instead of silently.

This is the one place shims live; `install()` runs before `import sglang`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Root package -> why it is stubbed (checked at install(): a real package wins).
STUBBED = {
    "torchvision": "vision transforms of multimodal processors; never reached by "
    "the scheduler and memory pools",
}


class ShimUsed(RuntimeError):
    """A stubbed package was really used: the driven path needs it."""


class _Placeholder:
    """Stands for any attribute of a stubbed module; using it raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ShimUsed(f"{self._name} is a kvcheck import shim (impl/sglang/shims.py)")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<kvcheck shim {self._name}>"


class _ShimModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _ShimModule(spec.name)
        mod.__path__ = []
        mod.__kvcheck_shim__ = True
        # transformers probes a package's version; an old one keeps its
        # version-gated vision paths off.
        mod.__version__ = "0.0.0"
        return mod

    def exec_module(self, module):
        return None


def install() -> list[str]:
    """Stub every package of STUBBED that is not really importable; return them."""
    missing = [r for r in STUBBED if r not in sys.modules and importlib.util.find_spec(r) is None]
    if missing and not any(isinstance(f, _ShimFinder) for f in sys.meta_path):
        sys.meta_path.append(_ShimFinder(missing))
    return missing
