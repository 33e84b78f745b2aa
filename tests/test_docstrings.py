"""Every example in symmem's docstrings runs and prints what it shows (doctest), as the
README's and the --help texts' commands do (tests/test_examples.py)."""
import doctest
import importlib
import pkgutil

import pytest

import symmem

MODULES = sorted(m.name for m in pkgutil.walk_packages(symmem.__path__, "symmem."))


def test_modules_have_examples():
    examples = sum(len(t.examples) for name in MODULES
                   for t in doctest.DocTestFinder().find(importlib.import_module(name)))
    assert examples >= 20


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
