"""Stand-in packages that answer any submodule and any attribute.

``transformers`` probes ``torchvision`` and imports submodules such as ``torchvision.io``;
SGLang imports ``torchvision.transforms`` and ``sgl_kernel.*`` at module level. A stand-in must
therefore import under every dotted name. Attributes are placeholders: classes for
``torchvision`` (used in type annotations and ``isinstance`` checks), callables that raise for
``sgl_kernel`` (they must never run on CPU; if one does, the error names it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable


class _StubModule(types.ModuleType):
    def __init__(self, name: str, make_attr: Callable[[str, str], object]) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__stub__ = True
        self._make_attr = make_attr

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = self._make_attr(self.__name__, attr)
        setattr(self, attr, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str, make_attr: Callable[[str, str], object], missing: frozenset[str]) -> None:
        self.root = root
        self.make_attr = make_attr
        self.missing = missing

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname in self.missing:
            return None  # callers that guard this import with `except ImportError` take their fallback
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        return _StubModule(spec.name, self.make_attr)

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def install(root_module: types.ModuleType, make_attr: Callable[[str, str], object],
            missing: tuple[str, ...] = ()) -> None:
    """Make ``root_module`` (an imported stand-in package) answer any attribute and submodule.

    Submodules named in ``missing`` (relative names) are reported as absent instead.
    """
    root = root_module.__name__
    if not any(isinstance(f, _StubFinder) and f.root == root for f in sys.meta_path):
        full = frozenset(f"{root}.{m}" for m in missing)
        sys.meta_path.append(_StubFinder(root, make_attr, full))

    def module_getattr(attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = make_attr(root, attr)
        setattr(root_module, attr, value)
        return value

    root_module.__getattr__ = module_getattr  # type: ignore[method-assign]


class _PlaceholderMeta(type):
    """Class-level attribute access (``InterpolationMode.NEAREST``) yields further placeholders."""

    def __getattr__(cls, attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = placeholder_class(cls.__module__, f"{cls.__name__}.{attr}")
        setattr(cls, attr, value)
        return value


def placeholder_class(module: str, name: str) -> type:
    def _init(self, *args, **kwargs) -> None:  # noqa: ANN001
        raise RuntimeError(f"{module}.{name} is a CPU test stand-in and cannot be used")

    return _PlaceholderMeta(name.rsplit(".", 1)[-1], (), {"__module__": module, "__init__": _init,
                                                          "__qualname__": name})


def raising_function(module: str, name: str) -> Callable[..., object]:
    def _raise(*args, **kwargs) -> object:  # noqa: ANN002
        raise RuntimeError(f"{module}.{name} is a CPU test stub (no sgl_kernel here)")

    _raise.__name__ = name
    _raise.__qualname__ = name
    _raise.__module__ = module
    return _raise
