"""fxpipe/__init__.py: the package's names load on first use, so pure modules need no torch.

``partition.py`` (and the plan it feeds) must run where torch is not installed: plans are
made and checked there. Each module is imported in a fresh interpreter in which any import
of torch fails as it would without torch installed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import fxpipe

NO_TORCH = textwrap.dedent("""
    import importlib.abc
    import sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    import MODULE
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, loaded
""")


@pytest.mark.parametrize("module", ["fxpipe.plan", "fxpipe.plan._partition", "fxpipe.plan._routes", "fxpipe.plan._value",
                                    "fxpipe.capture._node_kinds"])
def test_pure_module_imports_without_torch(module):
    root = os.path.dirname(os.path.dirname(os.path.abspath(fxpipe.__file__)))  # this checkout's fxpipe
    result = subprocess.run([sys.executable, "-c", NO_TORCH.replace("MODULE", module)], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_lazy_names_resolve_to_their_definitions():
    from fxpipe.api import Pipeline, pipeline
    from fxpipe.gpipe import GPipe
    from fxpipe.plan._value import Plan
    from fxpipe.runtime._checkpoint import is_checkpointing, is_recomputing

    assert (fxpipe.pipeline, fxpipe.Pipeline, fxpipe.Plan, fxpipe.GPipe) == (pipeline, Pipeline, Plan, GPipe)
    assert (fxpipe.is_checkpointing, fxpipe.is_recomputing) == (is_checkpointing, is_recomputing)
    assert fxpipe.balance.balance_by_time and fxpipe.skip.skippable and fxpipe.errors.TraceError
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        fxpipe.nonexistent  # noqa: B018


def test_every_public_name_is_listed_and_importable():
    assert set(fxpipe.__all__) <= set(dir(fxpipe))
    namespace: dict = {}
    exec("from fxpipe import *", namespace)
    assert set(fxpipe.__all__) <= set(namespace)


def test_modules_inside_the_subpackages_are_private():
    """As torch names its own: every module inside capture/, checks/, plan/, emit/, runtime/,
    cli/ and distributed/ starts with '_', but the public distributed/trace.py; the public
    surface is fxpipe/__init__ and the top-level modules."""
    from pathlib import Path

    root = Path(fxpipe.__file__).resolve().parent
    public = {"distributed/trace.py"}
    named = [str(p.relative_to(root)) for pkg in ("capture", "checks", "plan", "emit", "runtime", "cli", "distributed")
             for p in (root / pkg).rglob("*.py")
             if p.name != "__init__.py" and not p.name.startswith("_")
             and str(p.relative_to(root)) not in public]
    assert not named, f"modules inside the subpackages without a leading underscore: {named}"
