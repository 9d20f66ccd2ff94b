"""fadev's Python imports run one way (ISSUE 12 §1): the import graph of the package, read with ast from
every module's module-level and function-level ``import`` / ``from`` statements, has no cycle; a lower layer
never imports a higher one; the library layers import fadev modules at module level only (no function-local
import dodging a cycle); ``import fadev`` does not import torch, and ``fadev.torch`` is a lazy submodule.

Layers, lowest first: _core -> formats -> policy -> _args -> cuda -> ring_steps -> backends -> {attention,
backward, ring, native, metrics} -> fadev (the package namespace, __init__) -> {torch, torch_native, monitor, hf, weights, sweep,
experiments, training, report, plots, ...} -> __main__. A top-level module not named here belongs to the
applications layer.
"""
import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest
from helpers import find_cycle

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fadev"

LAYERS = [("_core",), ("formats",), ("policy",), ("_args",), ("cuda",), ("cuda_plans",), ("ring_steps",), ("backends",),
          ("attention", "backward", "ring", "native", "metrics"), ("",)]
APPLICATIONS, MAIN = len(LAYERS), len(LAYERS) + 1
LIBRARY = ({name for layer in LAYERS for name in layer if name}
           | {"torch", "torch_tensors", "torch_native", "monitor", "hf", "weights"})  # module-level imports only


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    """{dotted name: path} of every module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    """The layer of a dotted module name (fadev.experiments.common -> the applications layer)."""
    top = name.split(".")[1] if "." in name else ""
    if top == "__main__":
        return MAIN
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return APPLICATIONS


def imports(name: str, path: pathlib.Path, known: set):
    """(imported fadev module, line, inside a function) for every import statement of the module."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    found = []

    def target(dotted):
        # `from fadev import x`: the submodule fadev.x when it exists, else the package itself
        return dotted if dotted in known or dotted == "fadev._core" else None

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "fadev" or alias.name.startswith("fadev."):
                        found.append((alias.name, child.lineno, inner))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base.split(".")
                    anchor = anchor[:len(anchor) - (child.level - 1)]
                    mod = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod != "fadev" and not mod.startswith("fadev."):
                    continue
                for alias in child.names:
                    sub = target(f"{mod}.{alias.name}")
                    found.append((sub or mod, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def graph():
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def test_the_walk_sees_the_package():
    g = graph()
    assert {"fadev", "fadev.formats", "fadev.policy", "fadev._args", "fadev.cuda", "fadev.attention",
            "fadev.native", "fadev.torch"} <= set(g)
    assert ("fadev._args", False) in [(m, inside) for m, _, inside in g["fadev.attention"]]
    # relative imports are resolved: fadev.backward's `from . import cuda as _cuda`
    assert any(m == "fadev.cuda" for m, _, _ in g["fadev.backward"])


def module_graph(g):
    """The import graph as {module: [fadev modules it imports]}, self-imports and outside modules left out."""
    return {node: [dep for dep, _, _ in deps if dep != node and dep in g] for node, deps in g.items()}


def test_find_cycle_finds_one():
    g = {"a": [("b", 1, False)], "b": [("c", 1, True)], "c": [("a", 1, False)]}
    assert find_cycle(module_graph(g)) == ["a", "b", "c", "a"]
    assert find_cycle(module_graph({"a": [("b", 1, False)], "b": [], "c": [("a", 1, False)]})) is None
    # a module importing its own name (``from . import x`` inside the package __init__) is not a cycle
    assert find_cycle(module_graph({"a": [("a", 1, False), ("numpy", 2, False)]})) is None


def test_no_import_cycle():
    cycle = find_cycle(module_graph(graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards_only():
    bad = [f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)}) at line {line}"
           for name, deps in graph().items() for dep, line, _ in deps
           if dep != name and layer(dep) > layer(name)]
    assert not bad, "\n".join(bad)


def test_library_modules_import_fadev_at_module_level_only():
    bad = [f"{name}:{line} imports {dep} inside a function" for name, deps in graph().items()
           if name.split(".")[-1] in LIBRARY for dep, line, inside in deps if inside]
    assert not bad, "\n".join(bad)


def test_import_fadev_does_not_import_torch():
    code = "import sys, fadev; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_fadev_torch_is_a_lazy_submodule():
    code = ("import sys, fadev; assert 'fadev.torch' not in sys.modules; f = fadev.torch.attention; "
            "assert 'torch' in sys.modules and fadev.torch is sys.modules['fadev.torch']; print(f.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.strip() == "attention", out.stderr


def test_unknown_attributes_still_raise():
    import fadev
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        fadev.no_such_thing  # noqa: B018


def test_one_kernel_vocabulary():
    """Every module's kernel choices are names of fadev.backends.KERNELS; subset refuses any other."""
    import fadev.backends as backends
    import fadev.distributed
    import fadev.hf
    import fadev.sweep.schema
    import fadev.torch
    for choices in (fadev.torch.KERNELS, fadev.hf.KERNELS, fadev.distributed.KERNELS, fadev.sweep.schema._KERNELS):
        assert set(choices) <= set(backends.KERNELS), choices
    with pytest.raises(ValueError, match="emulation"):
        backends.subset("flash", "emulation")


def test_public_options_are_keyword_only_with_one_default_per_concept():
    """Options after the data arguments are keyword-only, and one concept has one default everywhere (the
    ring layout, the native backward's determinism)."""
    import inspect

    import fadev
    import fadev.distributed as fd
    import fadev.experiments as fe
    import fadev.torch as ft
    import fadev.torch_native as tn

    def params(fn):
        return inspect.signature(fn).parameters

    cases = {fadev.random_qkv: "dist", fadev.round: "seed", fadev.custom_format: "subnormals", fd.shard: "layout",
             fd.unshard: "layout", fe.run: "size", fe.run_one: "size", ft.attention: "kernel"}
    for fn, option in cases.items():
        assert params(fn)[option].kind is inspect.Parameter.KEYWORD_ONLY, (fn.__qualname__, option)
    layouts = {params(fn)["layout"].default for fn in (fadev.ring_attention, fd.ring_attention, fd.shard, fd.unshard)}
    assert layouts == {"contiguous"}
    assert params(fadev.native_attention_backward)["deterministic"].default is True
    assert params(tn.native_attention)["deterministic"].default is True
