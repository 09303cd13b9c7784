"""The engine's layout, read from its source (no MLX): an object's attributes are set by its own
class's code, and the batch's bookkeeping is read through `Batch` alone.

A class with behaviour takes its settings as constructor arguments or through a method of its
own (`BatchRunner(fuse_prefill=..., grouping=...)`, `DecodeBatch.forwards_through(model)`,
`Planner.take_embeds()`), never as an attribute someone else sets. A function may fill in an
object it builds itself; what else may be set from outside is listed in `ALLOWED`, each entry
with its reason: records, and mlx / mlx-lm / mlx-vlm objects set up the way those libraries
are meant to be.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SERVICER = Path(__file__).resolve().parent.parent / "servicer"
ENGINE = SERVICER / "engine"
SELF = ("self", "cls")

# Plain data with no invariants of its own (a dataclass, or a message struct), which its
# module's code fills in (a class with behaviour would get a method instead).
RECORD = "record"
# An mlx / mlx-lm / mlx-vlm object whose public attributes are its interface: a model's module
# patched or swapped at load, or a cache's state built as mlx-lm's own `extract` / `merge` /
# `state` setters build it (this package's cache kinds extend mlx-lm's).
MLX = "mlx object"

# (module under servicer/engine, the object whose attribute is set) -> why that is allowed.
ALLOWED: dict[tuple[str, str], str] = {
    ("batch.py", "row"): RECORD,  # rows.Row: the tokens it generated
    ("batch.py", "event"): RECORD,  # messages.RowEvent: its logprobs, attached after the step
    ("embedding.py", "job"): RECORD,  # embedding._Job: its cache and progress
    ("encoding.py", "stage"): RECORD,  # encoding._Stage: its arrays dropped once computed
    ("engine.py", "out"): RECORD,  # messages.StepOutput: the step's counts
    ("figures.py", "out"): RECORD,  # messages.StepOutput: the figures it carries
    ("figures.py", "published"): RECORD,  # figures.Published: what was last sent, and when
    ("prefix/disk_tier.py", "self.counters"): RECORD,  # disk_tier.DiskCounters, the tier's own
    ("prefix/index.py", "node"): RECORD,  # index.Node: the index's own nodes
    ("prefix/index.py", "each"): RECORD,  # index.Node
    ("prefix/store.py", "self.counters"): RECORD,  # store.StoreCounters, the store's own
    ("prefix/store.py", "counts"): RECORD,  # store.TierCounts
    ("prompt_batch.py", "row"): RECORD,  # prompt_batch.PromptRow
    ("rows.py", "row"): RECORD,  # rows.Row: the book's own rows
    ("runner.py", "row"): RECORD,  # prompt_batch.PromptRow: a fused chunk's tokens
    ("speculation/batch.py", "response"): RECORD,  # decode_batch.DecodeResponse
    ("speculation/batch.py", "row"): RECORD,  # decode_batch.DecodeResponse (a row's, by step)
    ("speculation/config.py", "window"): RECORD,  # config._Window
    ("speculation/draft_model.py", "lane"): RECORD,  # draft_model._Lane
    ("adapters.py", "parent"): MLX,  # a model's module: a linear swapped for its LoRA layer
    ("arch_fixes.py", "module"): MLX,  # a model's module: its class swapped for a batched one
    ("arch_fixes.py", "layer.self_attn"): MLX,  # phi3small's attention: its mask flag
    # While a staged encoder pass is built (and put back after): a model's own evals wait,
    # and the fused attention is made by query rows.
    ("encoding.py", "mx"): MLX,
    ("encoding.py", "fast"): MLX,
    ("fused_prefill.py", "attention"): MLX,  # an attention: its class swapped (packed forwards)
    ("mrope.py", "attention"): MLX,  # an attention: its rope swapped for multimodal RoPE
    ("vision.py", "stack"): MLX,  # mlx-vlm's language stack: no layers of its own, our embedding
    ("vision.py", "owner"): MLX,  # the text model: its class swapped to take scaled embeddings
    ("vision.py", "layer"): MLX,  # a text layer: its class swapped to add deepstack features
    ("vision.py", "model"): MLX,  # a text model without input_embeddings: its class swapped
    ("vision.py", "embed"): MLX,  # its token embedding: its class swapped to hand them over
    ("model.py", "args"): MLX,  # mlx-lm's ModelArgs: rope_scaling kept where a model drops it
    ("prefix/store.py", "quantized"): MLX,  # a quantized row cache, built from a block's state
    ("quantized_kv.py", "row"): MLX,  # extract: the row's cache, built as mlx-lm's extract does
    ("quantized_kv.py", "obj"): MLX,  # a descriptor's __set__ storing on its owner instance
    ("speculation/caches.py", "cache"): MLX,  # extract: a row's cache, as mlx-lm's extract does
}


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(ENGINE.rglob("*.py")):
        yield path.relative_to(ENGINE).as_posix(), ast.parse(path.read_text(), str(path))


def _receiver(node: ast.expr) -> str:
    """The object whose attribute is set, as written (a subscript's container: `row[i].x`
    sets an attribute of an element of `row`)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return ast.unparse(node)


def _attribute_sets(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """Every attribute assignment, augmented assignment, deletion and setattr / delattr call:
    (line, the object, the code)."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            yield node.lineno, _receiver(node.args[0]), ast.unparse(node)
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute):
                yield target.lineno, _receiver(target.value), ast.unparse(target)


def _built_here(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The local names `function` binds to an object it builds itself: a call of a class (a
    capitalised name, or `cls`), which it may fill in (test_layout's rule for the handler
    side, too)."""
    built = set()
    for node in ast.walk(function):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Call):
            callee = value.func
            name = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            if name[:1].isupper() or name == "cls":
                built.add(target.id)
    return built


def _foreign_sets(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    """The attribute sets on an object that is neither `self`, `cls` nor one the function
    that sets it built: (line, the object, the code)."""
    own = {(line, code) for line, receiver, code in _attribute_sets(tree) if receiver in SELF}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            built = _built_here(node)
            own |= {(line, code) for line, r, code in _attribute_sets(node) if r in built}
    for line, receiver, code in _attribute_sets(tree):
        if (line, code) not in own:
            yield line, receiver, code


def test_engine_code_sets_only_its_own_attributes():
    """No attribute of another object is set (`x.y = ...`, `self.x.y = ...`, setattr), but of
    an object the function built itself, and of the records and mlx objects `ALLOWED` lists;
    every entry there is still needed."""
    found, used = [], set()
    for module, tree in _modules():
        for line, receiver, code in _foreign_sets(tree):
            if (module, receiver) in ALLOWED:
                used.add((module, receiver))
            else:
                found.append(f"servicer/engine/{module}:{line}: {code}")
    assert not found, "attributes set from outside their class:\n" + "\n".join(found)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"entries of ALLOWED that nothing needs any more: {stale}"


def _book_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every `.book` / `._book` outside class Batch's own body."""

    def visit(node: ast.AST, in_batch: bool) -> Iterator[tuple[int, str]]:
        if isinstance(node, ast.ClassDef):
            in_batch = node.name == "Batch"
        if isinstance(node, ast.Attribute) and node.attr in ("book", "_book") and not in_batch:
            yield node.lineno, ast.unparse(node)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, in_batch)

    yield from visit(tree, False)


def test_the_batchs_bookkeeping_is_read_through_batch():
    """Only `Batch` reads its `RowBook`: everyone else asks `Batch` (`starting`,
    `generated`, `tickets()`, `handed_over()`, ...)."""
    found = []
    for path in sorted(SERVICER.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for line, code in _book_reads(tree):
            found.append(f"{path.relative_to(SERVICER.parent)}:{line}: {code}")
    assert not found, "the batch's book read outside Batch:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for():
    """The walkers find the shapes they forbid (a check that finds nothing proves nothing),
    and pass an object's own code and what a function builds itself."""
    tree = ast.parse(
        "class Runner:\n"
        "    def f(self):\n"
        "        self.a = 1\n"
        "        self.decoding.model = 2\n"
        "        other.x, (y.z, _) = 3, (4, 5)\n"
        "        rows[0].w += 1\n"
        "        setattr(thing, 'v', 6)\n"
        "        made = Made()\n"
        "        made.u = 7\n"
        "        return batch.book.starting\n"
        "    @classmethod\n"
        "    def g(cls):\n"
        "        new = cls()\n"
        "        new.t = 8\n"
        "class Batch:\n"
        "    def h(self):\n"
        "        return self._book.starting\n"
    )
    sets = sorted((receiver, code) for _, receiver, code in _foreign_sets(tree))
    assert sets == [
        ("other", "other.x"),
        ("rows", "rows[0].w"),
        ("self.decoding", "self.decoding.model"),
        ("thing", "setattr(thing, 'v', 6)"),
        ("y", "y.z"),
    ]
    assert [code for _, code in _book_reads(tree)] == ["batch.book"]
