"""The layering rules of ../shared/DESIGN.md ("Layout"), checked on the source: every import
(top level, inside functions, and under TYPE_CHECKING alike: a dependency is a dependency) is
resolved to a file, and the test fails on a file-level import cycle, on an import that crosses
the layers the wrong way, on torch/numpy/triton in edgeinfer/core/, and on a file over the line
budget. It reads files only; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edgeinfer", "kernels", "quant", "transport")
MAX_LINES = 400
LINE_BUDGETS = {"edgeinfer/core/scheduler.py": 300}

# quant/ is two layers: the file formats (below models/) and the conversion tool (above worker/).
QUANT_TOOL = {"quant/convert.py", "quant/calibrate.py", "quant/awq.py", "quant/export_gguf.py",
              "quant/export_ctensors.py", "quant/perplexity.py", "quant/sources.py", "quant/budget.py"}

# layer -> the layers its files may import (besides their own).
ALLOWED = {
    "config": set(),
    "formats": {"config"},
    "kernels": {"formats"},
    "core": {"config"},
    "models": {"config", "formats", "kernels"},
    "worker": {"config", "formats", "kernels", "core", "models"},
    "engine": {"config", "formats", "kernels", "core", "models", "worker"},
    # eval-ppl runs on the engine, like every front end (docs/ARCHITECTURE.md says why).
    "quant_tool": {"config", "formats", "kernels", "core", "models", "worker", "engine"},
    "transport": {"config", "core", "engine", "tokenizer"},
    "cli": {"config", "formats", "kernels", "core", "models", "worker", "engine", "quant_tool", "transport"},
}
for _layers in ALLOWED.values():  # the tokenizer is part of models/ for everyone else
    if "models" in _layers:
        _layers.add("tokenizer")
ALLOWED["models"].add("tokenizer")
ALLOWED["tokenizer"] = {"config"}
NO_TENSORS = {"core": ("torch", "numpy", "triton")}


def layer_of(path: str) -> str:
    if path == "edgeinfer/config.py":
        return "config"
    if path == "edgeinfer/cli.py" or path.startswith("edgeinfer/cli/"):
        return "cli"
    if path == "edgeinfer/models/tokenizer.py":
        return "tokenizer"  # a models/ file that transport/ may use (chat templates, detokenizing)
    top, rest = path.split("/", 1)
    if top == "edgeinfer":
        sub = rest.split("/", 1)[0]
        if sub in ("core", "models", "worker", "engine"):
            return sub
        if sub == "__init__.py":
            return "config"
        raise AssertionError(f"{path}: a file of edgeinfer/ outside core/, models/, worker/, engine/ "
                             "(only config.py and the cli live at the top)")
    if top == "quant":
        return "quant_tool" if path in QUANT_TOOL else "formats"
    return top


def source_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_file(module: str, files: set[str]) -> str | None:
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in files:
            return candidate
    return None


def imports_of(path: str, files: set[str]) -> tuple[set[str], set[str]]:
    """(project files this file imports, top-level names of the other modules it imports)."""
    tree = ast.parse((ROOT / path).read_text(), path)
    package = path.rsplit("/", 1)[0].replace("/", ".")
    found: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            # `from pkg import name` names a module when pkg/name.py exists, else something in pkg.
            names = [f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}", files) else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            target = module_file(name, files)
            if target is not None:
                found.add(target)
            elif name.split(".")[0] not in PACKAGES:
                external.add(name.split(".")[0])
    found.discard(path)
    return found, external


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = source_files()
    known = set(files)
    graph, external = {}, {}
    for path in files:
        graph[path], external[path] = imports_of(path, known)
    return graph, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_imports_run_down_the_layers() -> None:
    graph, external = import_graph()
    crossings = []
    for path, targets in graph.items():
        layer = layer_of(path)
        for target in sorted(targets):
            other = layer_of(target)
            if other != layer and other not in ALLOWED[layer]:
                crossings.append(f"{path} ({layer}) imports {target} ({other})")
        for name in sorted(external[path] & set(NO_TENSORS.get(layer, ()))):
            crossings.append(f"{path} ({layer}) imports {name}")
    assert crossings == []


def test_files_stay_small() -> None:
    too_long = []
    for path in source_files():
        lines = len((ROOT / path).read_text().splitlines())
        if lines > LINE_BUDGETS.get(path, MAX_LINES):
            too_long.append(f"{path}: {lines} lines (budget {LINE_BUDGETS.get(path, MAX_LINES)})")
    assert too_long == []


def test_the_checker_sees_cycles_and_nested_imports() -> None:
    """The oracle for the checker itself: a hand-made graph and this very file."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    files = set(source_files())
    # transport/service.py imports the engine inside a function: it must be seen.
    found, _ = imports_of("transport/service.py", files)
    assert any(f.startswith("edgeinfer/engine") for f in found), found
