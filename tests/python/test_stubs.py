"""The .pyi stubs cover the extension: every public class, function and attribute has a stub."""
import ast
import inspect
from pathlib import Path

import qkvshare
from qkvshare import _core


def stub_names():
    stub = Path(_core.__file__).with_name("_core.pyi")
    if not stub.is_file():  # installed next to the extension by `pip install .`
        stub = Path(__file__).resolve().parents[2] / "python" / "qkvshare" / "_core.pyi"
    tree = ast.parse(stub.read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))
                                and hasattr(n, "name")} | {n.target.id for n in node.body
                                                           if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = set()
    return names


def test_stub_covers_module():
    names = stub_names()
    for name in qkvshare.__all__:
        assert name in names, f"{name} has no stub"
        obj = getattr(_core, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            public = {a for a in vars(obj) if not a.startswith("_")}
            missing = public - names[name]
            assert not missing, f"{name}: no stub for {sorted(missing)}"
