"""How a forward runs is decided once (issue 52): no module outside runtime/backends/ and the two
modules that choose (runtime/platform.py's policies, runtime/run_plan.py's plan) compares the
attention backend's name, and no layer asks the forward which backend runs it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "agentrt"
BACKEND_NAMES = {"torch", "cpu", "triton"}
CHOOSERS = {"runtime/platform.py", "runtime/run_plan.py", "runtime/config.py"}  # config: validates the flag


def _names_a_backend(node: ast.AST) -> bool:
    text = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "backend" in text.lower()


def _backend_literals(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & BACKEND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_backend_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def backend_name_reads(source: str, name: str) -> list[str]:
    """`name:line` of every comparison of a name or attribute called *backend* with a backend's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_backend(s) for s in sides) and any(_backend_literals(s) for s in sides):
                found.append(f"{name}:{node.lineno}")
    return found


def test_only_the_backends_and_the_choosers_read_the_backend_name():
    reads = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        if "runtime/backends/" not in path.as_posix() and path.relative_to(ROOT).as_posix() not in CHOOSERS
        for hit in backend_name_reads(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not reads, (
        f"the backend's name read outside runtime/backends/ (pass the Backend object down): {reads}"
    )


def test_the_guard_sees_a_backend_name_read():
    source = 'def f(runner, backend):\n    x = runner.attention_backend in ("cpu", "torch")\n    return backend == "triton"\n'
    assert backend_name_reads(source, "probe.py") == ["probe.py:2", "probe.py:3"]
    assert backend_name_reads('def f(device):\n    return device == "cpu"\n', "probe.py") == []


def test_no_layer_asks_the_forward_how_it_runs():
    """The layers and the model get their ops when built: no `fused` flag, no `getattr(meta, ...)`
    probe, no kernel attribute set on a layer from outside."""
    offenders = []
    for path in [*(ROOT / "runtime" / "layers").glob("*.py"), ROOT / "runtime" / "models" / "base.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg == "fused":
                offenders.append(f"{path.name}:{node.lineno} a `fused` argument")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "meta"
            ):
                offenders.append(f"{path.name}:{node.lineno} a probe of the metadata")
            if isinstance(node, ast.Attribute) and node.attr in ("ops_fused", "cpu_kernel"):
                offenders.append(f"{path.name}:{node.lineno} reads `{node.attr}`")
    assert not offenders, offenders
