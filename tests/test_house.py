"""The shape of the house: hearth's modules import only downward, no two import each other, and no
function or file grows past what a reader takes in at once.

The layers are LAYERS below, top to bottom; docs/architecture.md ("Layers") shows the same table,
and test_the_docs_show_the_layer_table holds the two together. A module may import its own layer
and the layers below it; an import under `if TYPE_CHECKING:` (annotations only, never run) is
exempt. Imports inside functions count: they run too, only later. In hearth/engine/ only the
runners and the sampler (and its head run inside a backend's step) build tensors (TENSOR_MODULES): the rest is bookkeeping.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hearth"

# top to bottom: (layer, the modules and packages in it); a package stands for every module under it,
# but "hearth" for its own __init__.py only (the public API: LLM, SamplingParams, the outputs)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("fleet", ("hearth.fleet", "hearth.cli", "hearth.cli_generation")),
    ("server", ("hearth.server", "hearth.bench")),
    ("engine_args", ("hearth.engine_args",)),
    ("llm", ("hearth", "hearth.llm", "hearth.chat_images", "hearth.perplexity", "hearth.imatrix", "hearth.awq",
             "hearth.sparsify")),
    ("engine", ("hearth.engine", "hearth.model_info")),
    ("loading", ("hearth.loading",)),
    ("distributed", ("hearth.distributed",)),
    ("model", ("hearth.model",)),
    ("backend", ("hearth.backend",)),
    ("tokenizer", ("hearth.tokenizer", "hearth.watermark", "hearth.triton_kernels", "hearth.image_processor",
                    "hearth.image_processor_qwen", "hearth.image_processor_gemma",
                    "hearth.image_processor_gemma4", "hearth.video_processor_qwen", "hearth.videos")),
    ("config", ("hearth.config", "hearth.engine_config", "hearth.hf_config", "hearth.vision_config", "hearth.sampling_params",
                "hearth.lora_request", "hearth.quant")),
    ("ground", ("hearth.errors", "hearth.kv_format", "hearth.outputs", "hearth.native", "hearth.tool_calls",
                "hearth.chat_template", "hearth.tokenizer_gguf", "hearth.default_model", "hearth.options",
                "hearth.reasoning", "hearth.images", "hearth.child_process")),
]
# the engine's modules that build tensors; the others keep the engine's bookkeeping, tensor-free
TENSOR_MODULES = ("hearth.engine.runner", "hearth.engine.chain_passes", "hearth.engine.draft_runner", "hearth.engine.mtp_draft",
                  "hearth.engine.sampler", "hearth.engine.step_sampling")
TENSOR_BUILDERS = {"tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "empty", "zeros", "ones", "full",
                   "arange", "linspace", "eye", "rand", "randn", "randint", "randperm", "stack", "cat", "concat",
                   "concatenate", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"}
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
SOURCE_DIRS = ("hearth", "benchmarks", "recipes", "tests")
SOURCE_SUFFIXES = {".py", ".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh"}


def _modules() -> dict[str, Path]:
    """Every module under hearth/, by dotted name (a package by its own name: its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module `name` is, or the innermost module that holds it (a name defined in it)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (its else branch runs, and counts)."""
    exempt = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exempt.update(id(n) for statement in node.body for n in ast.walk(statement))
    return exempt


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The hearth modules an import statement of `module` names."""
    if isinstance(node, ast.Import):
        return [_resolve(a.name) for a in node.names if a.name.split(".")[0] == "hearth"]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "hearth":
        return []
    return [_resolve(f"{base}.{a.name}") for a in node.names]


def _imports() -> dict[str, dict[str, int]]:
    """{module: {module it imports: the line of the first such import}}, TYPE_CHECKING blocks left out."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        exempt = _type_checking_only(tree)
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in exempt:
                for target in _imported(module, path, node):
                    if target != module:
                        edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def _layer(module: str) -> int | None:
    """The index in LAYERS (0: the top) of the most specific entry that holds `module`."""
    best, best_length = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            holds = module == entry or (entry != "hearth" and module.startswith(entry + "."))
            if holds and len(entry) > best_length:
                best, best_length = index, len(entry)
    return best


def _where(module: str, target: str, graph: dict[str, dict[str, int]]) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{graph[module][target]} imports {target}"


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None] == [], "add these modules to LAYERS (and docs/architecture.md)"


def test_imports_run_down():
    graph = _imports()
    upward = [f"{_where(module, target, graph)} ({LAYERS[_layer(target)][0]} above {LAYERS[_layer(module)][0]})"
              for module, edges in sorted(graph.items()) for target in sorted(edges)
              if _layer(module) is not None and _layer(target) is not None and _layer(target) < _layer(module)]
    assert upward == [], "imports that run up a layer:\n" + "\n".join(upward)


def _cycle_through(start: str, members: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle from `start` back to itself inside one strongly connected set of modules."""
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return path[::-1]
                if target in members and target not in parents:
                    parents[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while module not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    graph = _imports()
    cycles = []
    for component in _strongly_connected(graph):
        cycle = _cycle_through(min(component), component, graph)
        steps = [_where(m, cycle[(i + 1) % len(cycle)], graph) for i, m in enumerate(cycle)]
        cycles.append(f"{' <-> '.join(sorted(component))}, e.g.:\n  " + "\n  ".join(steps))
    assert cycles == [], "modules that import each other:\n" + "\n".join(cycles)


def test_in_the_engine_only_the_runners_and_the_sampler_build_tensors():
    built = []
    for module, path in MODULES.items():
        if module.split(".")[:2] == ["hearth", "engine"] and module not in TENSOR_MODULES:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in TENSOR_BUILDERS and ast.unparse(node.func.value) == "torch"):
                    built.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {ast.unparse(node.func)}")
    assert built == [], "tensors built in hearth/engine/ outside " + ", ".join(TENSOR_MODULES) + ":\n" + "\n".join(built)


def _documented_layers() -> list[tuple[str, tuple[str, ...]]]:
    """The rows of the table under docs/architecture.md's "## Layers": | layer | `module`, ... |."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")][1:]
    return [(layer.strip(), tuple(re.findall(r"`([\w.]+)`", modules))) for layer, modules, *_ in rows]


def test_the_docs_show_the_layer_table():
    assert _documented_layers() == LAYERS


def _source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*")
                  if p.suffix in SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts)


def test_no_function_over_60_lines():
    long = defaultdict(list)
    for path in _source_files():
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long[path].append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(sum(long.values(), []))


def test_no_source_file_over_600_lines():
    long = []
    for path in _source_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == [], f"source files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)
