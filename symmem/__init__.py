"""symmem: the GPU memory of deep-learning training as closed-form formulas.

The names below are imported when first used (PEP 562), so that ``import symmem`` costs
nothing and a command answered from the cache (:func:`symmem.cache.replay`) never imports
sympy: ``sm.estimate``, ``sm.models``, ``from symmem import Policy`` work as ever.
"""
from importlib import import_module

__all__ = ["estimate", "Estimate", "Evaluation", "canonical", "Policy", "Graph", "Node", "Param",
           "Repeat", "rule", "models", "symbols", "SymmemError", "ConfigError", "ShapeError",
           "UnknownName",
           "Parallel"]
__version__ = "0.1.0"

#: public name -> the submodule defining it ("" for a submodule itself)
_WHERE = {"estimate": "engine", "Estimate": "engine", "Evaluation": "engine", "canonical": "engine",
          "Policy": "policy", "Graph": "graph", "Node": "graph", "Param": "graph", "Repeat": "graph",
          "rule": "rules", "models": "", "symbols": "", "SymmemError": "errors",
          "ConfigError": "errors", "ShapeError": "errors", "UnknownName": "errors", "Parallel": "policy"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'symmem' has no attribute {name!r}")
    module = import_module(f".{_WHERE[name] or name}", __name__)
    value = module if not _WHERE[name] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
