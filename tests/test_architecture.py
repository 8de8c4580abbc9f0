"""The architecture's rules, checked on the source (docs/DESIGN.md, "Rooms"):

- no import cycle among the modules of lmsys/, kernels/, launch/ and tools/ (imports inside
  functions count: a lazy import still couples two modules);
- no module of lmsys/ over 700 lines, no function outside kernels/ over 100 lines;
- every command's `main` reports errors through `lmsys.cli.run_cli` (one exit path, one
  error vocabulary), and no module defines its own error base class outside lmsys/core/errors.py;
- an import inside a function of lmsys/, launch/ or tools/ says why it is late (a comment before
  it in that function);
- the code and docs cite nothing outside the repository (the docs they cite are in docs/);
- layers point one way (LAYERS, bottom to top): a module imports only modules of its own layer
  or of the layers below, so library code never imports a command or the command-line kit, the
  runtime kernels never import lmsys, and no runtime module (lmsys/, kernels/, launch/) imports
  the tools;
- Triton's interpreter switch (the TRITON_INTERPRET variable, triton.knobs' interpreter flag) is
  read and set in kernels/runtime.py alone;
- no package directory holds more than 15 modules;
- no two modules of lmsys/ share a basename (`__init__` and `__main__` aside): one meaning per name;
- one owner of the run directory (lmsys/core/rundir.py): no other module of lmsys/ or launch/ spells
  a run file's name or a metrics.jsonl record's field.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("lmsys", "kernels", "launch", "tools")
RUNTIME_PACKAGES = ("lmsys", "kernels", "launch")
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 100
MAX_PACKAGE_MODULES = 15

# Bottom to top. A module belongs to the layer of its longest matching prefix; the commands (every
# module with a `main`, the command-line kit, the launchers) are the layer below the tools.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("kernels", "lmsys.core")),
    ("model and data", ("lmsys.model", "lmsys.data")),
    ("engine and checkpoints", ("lmsys.engine",)),
    ("planning", ("lmsys.planning",)),
    (
        "training, inference, interop, sweeps",
        ("lmsys.training", "lmsys.inference", "lmsys.interop", "lmsys.sweep"),
    ),
    ("commands", ("lmsys", "launch", "lmsys.sweep.__main__")),
    ("tools", ("tools",)),
]
COMMANDS_LAYER = [name for name, _ in LAYERS].index("commands")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def _imported(module: str, tree: ast.Module) -> set[str]:
    """The project modules `module` imports, anywhere in its body."""
    targets: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from lmsys import checkpoint` imports the submodule; `from lmsys.x import f` the module
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = {name: _imported(name, tree) for name, tree in TREES.items()}
    # a package's __init__ importing its own submodules is not a cycle of concerns
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert _cycles(graph) == []


def test_module_sizes():
    too_long = {
        name: n
        for name, path in MODULES.items()
        if name.startswith("lmsys") and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert too_long == {}


TRAINER_MAX_LINES = 350  # the loop and its step; the run's other concerns are components


def test_the_trainer_stays_within_its_budget():
    lines = len((REPO / "lmsys" / "training" / "trainer.py").read_text().splitlines())
    assert lines < TRAINER_MAX_LINES, f"lmsys/training/trainer.py has {lines} lines"


def test_function_sizes():
    too_long = {}
    for name, tree in TREES.items():
        if name.startswith("kernels"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long[f"{name}.{node.name}"] = length
    assert too_long == {}


def test_every_command_exits_through_run_cli():
    """(kernels/ stands alone, without lmsys: its benchmark CLIs are its own.)"""
    commands = [
        name for name, tree in TREES.items() if any(_defines(tree, "main")) and not name.startswith("kernels")
    ]
    assert len(commands) >= 12, commands  # the five CLIs, benches, sweeps, launchers
    missing = [name for name in commands if "run_cli" not in ast.unparse(next(_defines(TREES[name], "main")))]
    assert missing == []


def _defines(tree: ast.Module, function: str):
    return (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)


def test_one_error_vocabulary():
    """Exceptions raised to users derive from lmsys.core.errors.LmsysError; no other module defines a
    base class of its own (a class deriving directly from a builtin exception)."""
    builtins = {"Exception", "ValueError", "RuntimeError", "TypeError", "OSError"}
    own_bases = []
    for name, tree in TREES.items():
        if name == "lmsys.core.errors" or name.startswith("kernels"):  # kernels/ stands alone: TypeError etc.
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if bases & builtins:
                    own_bases.append(f"{name}.{node.name}")
    assert own_bases == []


def test_late_imports_say_why():
    silent = []
    for name, tree in TREES.items():
        if name.startswith("kernels"):  # kernels/ has its own conventions (triton's import order)
            continue
        lines = MODULES[name].read_text().splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            imports = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
            if not imports:
                continue
            first = min(n.lineno for n in imports)
            if not any("#" in line for line in lines[node.lineno - 1 : first]):
                silent.append(f"{name}.{node.name} (line {first})")
    assert silent == []


TEXT_SUFFIXES = {".py", ".md", ".yaml", ".sbatch", ".toml"}


@pytest.mark.parametrize("document", ["docs/DESIGN.md", "docs/SPEC.md"])
def test_cited_docs_are_in_the_repository(document):
    assert (REPO / document).is_file()


def test_nothing_cites_files_outside_the_repository():
    outside = re.compile(r"\.\./shared|shared/(SPEC|DESIGN)\.md|shared/seeds")
    offenders = []
    for path in REPO.rglob("*"):
        if path.suffix not in TEXT_SUFFIXES or any(p.startswith(".") for p in path.relative_to(REPO).parts):
            continue
        if path.name == "test_architecture.py":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}")
    assert offenders == []


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's layer (its longest matching prefix)."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best >= 0, f"{module} is in no layer"
    return best


def test_layers_point_one_way():
    upward = []
    for name, tree in TREES.items():
        for target in _imported(name, tree):
            if layer_of(target) > layer_of(name):
                upward.append(
                    f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert upward == []


def test_the_layer_rule_sees_an_upward_import():
    assert layer_of("lmsys.model.ops") < layer_of("lmsys.cli") < layer_of("tools.bench.train")
    assert layer_of("kernels.flash_attention") < layer_of("tools.inspect.inspector")
    assert layer_of("launch.torchrun") < layer_of("tools.bench")
    assert layer_of("lmsys.sweep.summary") < layer_of("lmsys.sweep.__main__")
    assert layer_of("lmsys.core.config") < layer_of("lmsys.engine.zero") < layer_of("lmsys.training.trainer")
    assert (
        layer_of("lmsys.engine.zero")
        < layer_of("lmsys.planning.trace")
        < layer_of("lmsys.training.preflight")
    )


def test_training_imports_only_the_planners_check():
    """The planner is a package of its own: a launch calls its check (lmsys.planning.check), and
    nothing else of it, before the engine exists."""
    reaching = sorted(
        f"{name} imports {target}"
        for name, tree in TREES.items()
        if name.startswith("lmsys.training")
        for target in _imported(name, tree)
        if target.startswith("lmsys.planning") and target != "lmsys.planning.check"
    )
    assert reaching == []
    assert any(
        "lmsys.planning.check" in _imported(name, TREES[name])
        for name in TREES
        if name.startswith("lmsys.training")
    )


def test_every_command_is_in_a_command_layer():
    """Modules with a `main`: the commands, or the tools above them."""
    misplaced = [
        name
        for name, tree in TREES.items()
        if any(_defines(tree, "main")) and layer_of(name) < COMMANDS_LAYER
    ]
    assert misplaced == []


def test_no_runtime_module_imports_the_tools():
    """lmsys/, kernels/ and launch/ run without tools/: the tools sit above every layer."""
    assert [name for name, _ in LAYERS][-1] == "tools"
    leaks = [
        f"{name} imports {target}"
        for name, tree in TREES.items()
        if name.startswith(RUNTIME_PACKAGES)
        for target in _imported(name, tree)
        if target.startswith("tools")
    ]
    assert leaks == []


INTERPRETER_OWNER = "kernels.runtime"


def _interpreter_switch_uses(tree: ast.Module) -> list[int]:
    """Lines that name Triton's interpreter switch: the variable's name as a string of its own (an
    environment key; messages that mention `TRITON_INTERPRET=1` are not reads) or an attribute
    `interpret` (triton.knobs.runtime.interpret)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET")
        or (isinstance(node, ast.Attribute) and node.attr == "interpret")
    ]


def test_the_interpreter_switch_is_read_in_one_place():
    assert _interpreter_switch_uses(TREES[INTERPRETER_OWNER])  # the owner does read it
    others = {
        name: lines
        for name, tree in TREES.items()
        if name != INTERPRETER_OWNER and (lines := _interpreter_switch_uses(tree))
    }
    assert others == {}


def test_the_switch_finder_sees_both_ways_of_reading_it():
    code = [
        "import os, triton",
        'os.environ.get("TRITON_INTERPRET")',
        "triton.knobs.runtime.interpret",
        'print("set TRITON_INTERPRET=1")',
    ]
    assert sorted(_interpreter_switch_uses(ast.parse("\n".join(code)))) == [2, 3]


def test_runtime_kernels_stand_alone():
    """kernels/ runs without lmsys: its modules import only each other."""
    leaks = [
        f"{name} imports {target}"
        for name, tree in TREES.items()
        if name.startswith("kernels") and layer_of(name) == 0
        for target in _imported(name, tree)
        if not target.startswith("kernels") or layer_of(target) != 0
    ]
    assert leaks == []


def test_package_sizes():
    crowded = {}
    for package in PACKAGES:
        for directory in [REPO / package, *(p for p in (REPO / package).rglob("*") if p.is_dir())]:
            modules = list(directory.glob("*.py"))
            if len(modules) > MAX_PACKAGE_MODULES:
                crowded[str(directory.relative_to(REPO))] = len(modules)
    assert crowded == {}


def _shared_basenames(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Module basename -> the modules that bear it, where more than one does (__init__ and
    __main__ are every package's)."""
    bearers: dict[str, list[str]] = {}
    for name, path in modules.items():
        if path.stem not in ("__init__", "__main__"):
            bearers.setdefault(path.stem, []).append(name)
    return {stem: names for stem, names in bearers.items() if len(names) > 1}


# One meaning per name: a reader who opens `harness.py` finds the one module called so.
def test_no_two_modules_share_a_basename():
    assert _shared_basenames({n: p for n, p in MODULES.items() if n.split(".")[0] == "lmsys"}) == {}


def test_the_basename_check_sees_a_shared_name():
    modules = {
        "lmsys.a.plan": Path("lmsys/a/plan.py"),
        "lmsys.b.plan": Path("lmsys/b/plan.py"),
        "lmsys.a": Path("lmsys/a/__init__.py"),
        "lmsys.b": Path("lmsys/b/__init__.py"),
        "lmsys.sweep.__main__": Path("lmsys/sweep/__main__.py"),
        "lmsys.__main__": Path("lmsys/__main__.py"),
    }
    assert _shared_basenames(modules) == {"plan": ["lmsys.a.plan", "lmsys.b.plan"]}


# ----------------------------------------------------------------------------- the run directory's one owner

RUN_DIR_OWNER = "lmsys.core.rundir"
# Every file and directory of a run, named by the owner's constants and spelled nowhere else.
RUN_FILE_NAMES = [
    "config.yaml",
    "run.json",
    "deepspeed.json",
    "engine_stats.json",
    "metrics.jsonl",
    "loss.png",
    "eval.png",
    "checkpoints",
    "wandb",
    "diagnostics",
    "hang.txt",
    "skipped-data.json",
]
# The beginnings of the names the owner makes from a rank or a step (hang-rank-<K>.txt, ...).
RUN_FILE_PREFIXES = ["hang-rank-", "nonfinite-step-", "divergence-step-"]
# A name that is also a word of other formats or messages is not looked for, nor is a record field
# that another format names alike.
SHARED_WORDS = {
    "export": "a word of interop's messages",
    "kind": "a field of many formats (a bad step's report, a shard's source)",
    "step": "a field of every format that counts steps (checkpoints, the loader's state)",
    "loss": "a bad step's report, lmsys-eval's results",
    "lr": "the optimizer's param groups",
    "path": "an export's and the harness's metadata",
    "seconds": "the sweep's job records, timings of lmsys-prepare",
    "tokens": "the prepared data's manifest",
    "skipped": "the corpus scan's counts",
    "async": "the checkpoint benchmark's rows",
    "grad_norm": "a bad step's report",
    "ppl": "lmsys-eval's results",
    "mfu": "lmsys-plan's prediction",
    "tokens_per_s": "lmsys-plan's prediction, the sweep summary's columns",
    "step_time_s": "lmsys-plan's prediction",
}
# The tools (tools/bench's benchmarks) read the raw lines of metrics.jsonl (read_metrics) field by
# field, and clean a run's checkpoints by name: outside these two checks, as the kernels are.
BENCHMARKS = ("tools",)


def _docstrings(tree: ast.Module) -> set[int]:
    bodies = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)))
    return {
        id(n.body[0].value)
        for n in bodies
        if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def _spelled(names: set[str], prefixes: list[str], skip: tuple[str, ...] = BENCHMARKS) -> list[str]:
    """module:line: 'literal' for every string literal of lmsys/ and launch/ (docstrings aside)
    outside the owner that is one of `names` or, in an f-string, begins with one of `prefixes`."""
    found = []
    for name, tree in TREES.items():
        if name == RUN_DIR_OWNER or name.startswith(("kernels", *skip)):
            continue
        docstrings = _docstrings(tree)
        in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.Constant)
                or not isinstance(node.value, str)
                or id(node) in docstrings
            ):
                continue
            text = node.value
            if text in names or (id(node) in in_fstrings and text.startswith(tuple(prefixes))):
                found.append(f"{name}:{node.lineno}: {text!r}")
    return found


def test_the_run_file_names_are_the_owners():
    from lmsys.core import rundir

    constants = {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str)}
    assert set(RUN_FILE_NAMES) <= constants, set(RUN_FILE_NAMES) - constants
    assert str(rundir.hang_stacks_file(REPO, 3)).endswith("/" + RUN_FILE_PREFIXES[0] + "3.txt")
    assert rundir.bad_step_report_file(REPO, "diverging", 7).name.startswith(RUN_FILE_PREFIXES[2])
    # conf/'s root config is also called config.yaml: lmsys.core.config names it (ROOT_CONFIG)
    spelled = _spelled(set(RUN_FILE_NAMES), RUN_FILE_PREFIXES)
    assert [s for s in spelled if not s.startswith("lmsys.core.config:")] == []


def test_no_module_but_the_owner_spells_a_metrics_record_field():
    import dataclasses

    from lmsys.core import rundir

    fields = {"kind"} | {
        f.metadata.get(rundir.JSON_NAME, f.name)
        for r in rundir.RECORDS.values()
        for f in dataclasses.fields(r)
    }
    assert set(SHARED_WORDS) - {"export"} <= fields  # no stale entry
    distinctive = fields - set(SHARED_WORDS)
    assert {"measured_peak_bytes", "stall_s", "elapsed_s", "memory_gb"} <= distinctive
    assert _spelled(distinctive, []) == []


def test_the_owner_check_sees_a_spelled_name():
    tree = ast.parse('path = run_dir / "metrics.jsonl"\nrow["stall_s"]\nname = f"hang-rank-{rank}.txt"\n')
    TREES["lmsys.fake_module"] = tree
    try:
        assert [s for s in _spelled({"metrics.jsonl", "stall_s"}, RUN_FILE_PREFIXES) if "fake" in s] == [
            "lmsys.fake_module:1: 'metrics.jsonl'",
            "lmsys.fake_module:2: 'stall_s'",
            "lmsys.fake_module:3: 'hang-rank-'",
        ]
    finally:
        del TREES["lmsys.fake_module"]
