"""Zero-config registration of ``--model distperp`` with lm-eval.

lm-eval has no entry-point discovery for models. The installed ``distperp_harness_hook.pth`` imports this
module at interpreter start-up; it only puts a finder on ``sys.meta_path`` (stdlib, no torch, no lm-eval).
When ``lm_eval.api.registry`` is first imported, the finder lets it load normally, then registers the lazy
target ``distperp_harness.lm:DistPerpLM`` under the name ``distperp``. lm-eval's built-in models are
registered first (``import lm_eval.models``, itself lazy), so ``hf`` and ``dummy`` still resolve.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET_MODULE = "lm_eval.api.registry"


def register(registry_module) -> None:
    """Register ``distperp`` in lm-eval's model registry (idempotent)."""
    from distperp_harness import MODEL_NAME, MODEL_TARGET

    import lm_eval.models  # noqa: F401  (registers the built-in models, lazily)

    registry = registry_module.model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_TARGET)


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        register(module)


class _RegistryFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path``; register at once if lm-eval's registry is already loaded."""
    if _TARGET_MODULE in sys.modules:
        register(sys.modules[_TARGET_MODULE])
        return
    if not any(isinstance(f, _RegistryFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryFinder())


install()
