"""The layout keeps its promise: MLX stays on the engine side."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT

HANDLER_SIDE = [
    "servicer.handlers",
    "servicer.metadata",
    "servicer.validation",
    "servicer.messages",
    "servicer.text",
    "servicer.metrics",
    "servicer.tokenizer_bundle",
    "servicer.lifecycle",
    "servicer.model_files",
    "servicer.codec",
    "servicer.faults",
    "servicer.server",
    "servicer.cli",
    "servicer.engine_process",
    "servicer.engine_config",
    "servicer.grammar",
    "servicer.media",
    "servicer.numpy_processors",
    "servicer.vlm_modules",
    "servicer.engine.prefix.keys",
    "servicer.engine.prefix.index",
    "servicer.engine.prefix.snapshots",
    "servicer.engine.prefix",
    "servicer.engine",
    "servicer.outbox",
    "servicer.ratelimit",
    "servicer.streams",
    "servicer.output",
    "servicer.client",
    "servicer.proto.mlx_engine_pb2_grpc",
]


def test_handler_side_modules_never_import_mlx():
    probe = (
        f"import sys\nfor name in {HANDLER_SIDE!r}:\n    __import__(name)\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


# A class that has one job may take this many lines; past them it is doing two. (A class near
# the bound is not split to fit it: a split follows responsibilities, not a count.)
MAX_CLASS_LINES = 320
MAX_FUNCTION_LINES = 60
ARGUMENT_PARSERS = {"parse_args"}  # a flag table reads best in one place


def _package_trees():
    """(path, AST) of every module of the package but the generated code."""
    import ast

    for path in sorted((ROOT / "servicer").rglob("*.py")):
        if "proto" in path.relative_to(ROOT / "servicer").parts:
            continue  # generated
        yield path, ast.parse(path.read_text())


def test_classes_and_functions_stay_small():
    import ast

    too_long = []
    for path, tree in _package_trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"{path.name}: class {node.name} has {lines} lines")
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and lines > MAX_FUNCTION_LINES and node.name not in ARGUMENT_PARSERS:
                too_long.append(f"{path.name}: {node.name}() has {lines} lines")
    assert too_long == []


def _functions_outside_classes(node):
    """The functions defined in `node` that belong to no class (nested ones too)."""
    import ast

    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            continue
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield child
        yield from _functions_outside_classes(child)


# Stand-ins for an mlx-lm model or layer inside mlx-lm's own code, which reads the wrapped
# object's attributes through them: the one place forwarding is the point.
MODEL_PROXIES = {("fused_prefill.py", "FusingModel"), ("encoding.py", "_Recorder")}


def test_methods_live_in_their_classes():
    """No function outside a class takes `self` (a method in disguise, reaching into the
    object it is handed), and no class forwards unknown attributes with `__getattr__`: what a
    class offers is what it defines."""
    import ast

    found = []
    for path, tree in _package_trees():
        for function in _functions_outside_classes(tree):
            arguments = function.args.posonlyargs + function.args.args
            if arguments and arguments[0].arg == "self":
                found.append(f"{path.name}:{function.lineno} {function.name}() takes self")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (path.name, node.name) in MODEL_PROXIES:
                        continue
                    if isinstance(item, ast.FunctionDef) and item.name == "__getattr__":
                        found.append(f"{path.name}:{item.lineno} {node.name}.__getattr__")
    assert found == []


# The handler side, whose classes set only their own attributes: an object's state changes
# through its methods. An object a function builds itself (a message, a timer) it may fill.
OWN_ATTRIBUTES_ONLY = (
    "adapter_faces",
    "engine_calls",
    "engine_handle",
    "faces",
    "handlers",
    "images",
    "metadata",
    "output",
    "server",
    "streams",
    "validation",
    "vllm_face",
)


def _built_here(function) -> set[str]:
    """The local names `function` binds to an object it builds: a call of a capitalised name
    (a class), or a part of such an object (`response.chunk`)."""
    import ast

    built: set[str] = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, value = node.targets[0], node.value
        if not isinstance(target, ast.Name):
            continue
        if isinstance(value, ast.Call):
            callee = value.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            if name[:1].isupper():
                built.add(target.id)
        elif isinstance(value, ast.Attribute) and getattr(value.value, "id", "") in built:
            built.add(target.id)
    return built


def _foreign_assignments(tree) -> list[tuple[int, str]]:
    """(line, target) of each attribute assigned on an object that is neither `self`, `cls`
    nor one its function built."""
    import ast

    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        allowed = {"self", "cls"} | _built_here(function)
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for part in ast.walk(target):
                    if not (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)):
                        continue
                    owner = part.value
                    if not (isinstance(owner, ast.Name) and owner.id in allowed):
                        found.append((part.lineno, ast.unparse(part)))
    return sorted(set(found))


def test_handler_side_classes_set_only_their_own_attributes():
    import ast

    found = [
        f"{name}.py:{line} {target}"
        for name in OWN_ATTRIBUTES_ONLY
        for line, target in _foreign_assignments(
            ast.parse((ROOT / "servicer" / f"{name}.py").read_text())
        )
    ]
    assert found == []


def test_the_attribute_check_sees_foreign_assignments():
    import ast

    code = (
        "def f(self, stream):\n"
        "    self.ok = 1\n"
        "    stream.finish_reason = 'stop'\n"
        "    self.server.keys = {}\n"
        "    message = pb.Chunk()\n"
        "    message.index = 2\n"
        "    part = message.inner\n"
        "    part.text = 'x'\n"
    )
    found = _foreign_assignments(ast.parse(code))
    assert found == [(3, "stream.finish_reason"), (4, "self.server.keys")]


def _module_name(path, folder, package: bool) -> str:
    if not package:
        return path.stem
    parts = list(path.relative_to(folder.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(folder, package: bool) -> dict[str, set[str]]:
    """Module -> the modules of `folder` it imports (anywhere in its body, lazily too)."""
    import ast

    # Not what lies in hidden folders: the bench's side venvs (bench/.venv-smg, .venv-genai).
    paths = [
        p
        for p in folder.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(folder).parts)
    ]
    files = {_module_name(p, folder, package): p for p in paths}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_in_the_package_or_the_bench():
    package = _imports(ROOT / "servicer", package=True)
    assert package["servicer.messages"] >= {"servicer.admission"}  # the graph sees imports
    assert _circles(package) == []
    assert _circles(_imports(ROOT / "bench", package=False)) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_tests_and_bench_never_put_each_other_on_sys_path():
    """The bench's modules reach the tests through pytest's `pythonpath` (pyproject.toml), and
    the bench starts workers with its own code: no file edits sys.path to reach the other."""
    needle = "sys.path." + "insert"  # spelt apart so this file does not match itself
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("tests", "bench")
        for path in sorted((ROOT / folder).glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if needle in line and ('"bench"' in line or '"tests"' in line)
    ]
    assert offenders == []
