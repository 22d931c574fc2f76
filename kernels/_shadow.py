"""The checkout's `kernels/` folder shadows the hub `kernels` package: give the name back.

Python returns `sys.modules[name]` once a module's body has run, so a package may replace its own
entry. `hand_over_to_the_hub_package` finds `kernels` on sys.path without this checkout, runs it
under the name `kernels`, and leaves it in `sys.modules`: `from kernels import X` in transformers
then gets the hub package's X.
"""
import importlib.machinery
import importlib.util
import os
import sys

_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_checkout(entry: str) -> bool:
    try:
        return os.path.samefile(entry or os.curdir, _CHECKOUT)
    except OSError:
        return False


def hand_over_to_the_hub_package() -> bool:
    """Replace `sys.modules["kernels"]` with the hub package if one is installed; say whether it was."""
    search_path = [entry for entry in sys.path if not _is_checkout(entry)]
    spec = importlib.machinery.PathFinder.find_spec("kernels", search_path)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop(__name__, None)  # this helper module, `kernels._shadow`, is not the hub's
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
    return True
