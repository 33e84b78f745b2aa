"""symmem: the GPU memory of deep-learning training as closed-form formulas."""
from . import models, symbols
from .engine import Estimate, Evaluation, canonical, estimate
from .errors import ConfigError, ShapeError, SymmemError, UnknownName
from .graph import Graph, Node, Param, Repeat
from .policy import Parallel, Policy
from .rules import rule

__all__ = ["estimate", "Estimate", "Evaluation", "canonical", "Policy", "Graph", "Node", "Param",
           "Repeat", "rule", "models", "symbols", "SymmemError", "ConfigError", "ShapeError",
           "UnknownName",
           "Parallel"]
__version__ = "0.1.0"
