"""A stand-in for torchvision beside the CPU torch (PyPI's torchvision does not import with it).

SGLang's scheduler-side modules import ``torchvision.transforms`` at module level for vision
preprocessing that the classes kamera's tests use never run; transformers probes the package,
and its Qwen2-VL image processor module (which vLLM's Qwen2-VL imports) names torchvision types
in annotations while its slow, PIL path never calls them (`tests/engines/vllm/image_scenario.py`
puts this package on ``PYTHONPATH`` for that run only).
Every ``torchvision.*`` submodule resolves to an empty module; any attribute used raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Missing:
    """What a stub attribute is: anything may be looked up on it; using it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision is a stub here: {self._name} cannot run")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # a type annotation naming a stub (``Resampling | InterpolationMode``)
        return self

    __ror__ = __or__


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
