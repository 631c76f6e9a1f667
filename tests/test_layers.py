"""The import graph of `chatlearn/` and `flows/`: layers import downward only, and nothing imports in a loop.

Layers, lowest first (a module may import its own layer and the ones below):

    chatlearn.utils            helpers with no project imports
    chatlearn.config           the config: schema, loader, checks
    algorithms, data, checkpoint, tasks, tools, envs, and chatlearn.utils.arguments (ChatLearn's path to the config)
    chatlearn.models           ChatLearn's module API and the built-in Hugging Face modules
    chatlearn.runtime          actors, model groups, launch, plan, engines
    chatlearn                  the package's face
    flows                      Prefect flows and tasks
    chatlearn.cli              the command: it starts runs and registers the flows as deployments

Inside `chatlearn.runtime` the same rule holds between its parts, lowest first (`RUNTIME_LAYERS`): what the
engines' flows compile into, how the driver calls and waits, weight transfer, what a run records, the cluster's
processes, the run's spec and context, the rollout strategies, and what starts and runs a run.

The one upward arrow allowed: `chatlearn.runtime.engine` imports `flows.train_flow` / `flows.eval_flow`
inside `learn()` / `eval()`, because ChatLearn's API starts a run from the engine (documented there).
An import inside a function is allowed only with a comment saying why (on it or just above its block).
"""

import ast
import os
from collections import defaultdict

from tests.conftest import REPO

LAYERS = [
    ["chatlearn.utils"],
    ["chatlearn.config"],
    ["chatlearn.utils.arguments", "chatlearn.algorithms", "chatlearn.data", "chatlearn.checkpoint", "chatlearn.tasks",
     "chatlearn.tools", "chatlearn.envs"],
    ["chatlearn.models"],
    ["chatlearn.runtime"],
    ["chatlearn"],
    ["flows"],
    ["chatlearn.cli"],
]
RUNTIME_LAYERS = [
    ["chatlearn.runtime.compute_flow", "chatlearn.runtime.plan", "chatlearn.runtime.schedule"],
    ["chatlearn.runtime.calls"],
    ["chatlearn.runtime.weights"],
    ["chatlearn.runtime.records", "chatlearn.runtime.prefect"],
    ["chatlearn.runtime.cluster"],
    ["chatlearn.runtime.spec", "chatlearn.runtime.context"],
    ["chatlearn.runtime.rollout"],
    ["chatlearn.runtime.launch", "chatlearn.runtime.episodes", "chatlearn.runtime.engines",
     "chatlearn.runtime.prepared", "chatlearn.runtime.engine", "chatlearn.runtime"],
]
ALLOWED_UPWARD = {("chatlearn.runtime.engine", "flows.train_flow"), ("chatlearn.runtime.engine", "flows.eval_flow")}


def module_files() -> dict[str, str]:
    out = {}
    for top in ("chatlearn", "flows"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = path
    return out


def imports(path: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function?) for every import statement in the file."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            nested.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        for name in names:
            if name.split(".")[0] in ("chatlearn", "flows") or id(node) in nested:
                found.append((name, node.lineno, id(node) in nested))
    return found


def layer_of(module: str, layers: list[list[str]] = LAYERS) -> int:
    best, level = -1, -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level >= 0, f"{module} is in no layer: add it to the layers"
    return level


def graph() -> dict[str, set[str]]:
    files = module_files()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        for name, _, _ in imports(path, set(files)):
            if name in files:
                edges[mod].add(name)
    return edges


def test_imports_go_down_the_layers():
    upward = sorted((a, b) for a, targets in graph().items() for b in targets
                    if layer_of(b) > layer_of(a) and (a, b) not in ALLOWED_UPWARD)
    assert upward == []


def test_the_runtimes_parts_import_downward_only():
    # a loop between two sub-packages is no loop of modules (test_no_import_loops cannot see it): the runtime's
    # parts have an order of their own
    runtime = {m for m in module_files() if m.startswith("chatlearn.runtime")}
    upward = sorted((a, b) for a, targets in graph().items() if a in runtime for b in targets
                    if b in runtime and layer_of(b, RUNTIME_LAYERS) > layer_of(a, RUNTIME_LAYERS))
    assert upward == []


def test_the_one_upward_import_is_the_documented_one():
    edges = graph()
    assert {(a, b) for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a)} == ALLOWED_UPWARD
    assert not any("chatlearn.runtime.engine" in targets for mod, targets in edges.items() if mod.startswith("flows"))


def test_no_import_loops():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in module_files():
        if node not in index:
            visit(node)
    assert loops == []


def _commented(lines: list[str], i: int) -> bool:
    """A comment on the import's line, on another import of its block, or on the line above the block."""
    while i >= 0:
        if "#" in lines[i]:
            return True
        if not lines[i].strip().startswith(("import ", "from ")):
            return False
        i -= 1
    return False


def test_imports_inside_functions_say_why():
    files = module_files()
    silent = []
    for path in files.values():
        lines = open(path, encoding="utf-8").read().splitlines()
        for name, lineno, inside in imports(path, set(files)):
            if inside and not _commented(lines, lineno - 1):
                silent.append(f"{os.path.relpath(path, REPO)}:{lineno} imports {name}")
    assert silent == []


def test_the_layer_test_sees_a_new_upward_import(tmp_path, monkeypatch):
    # the checker itself: a data module importing the runtime is reported
    bad = tmp_path / "chatlearn" / "data"
    bad.mkdir(parents=True)
    (bad / "oops.py").write_text("from chatlearn.runtime.cluster.launch import launch\n")
    files = {"chatlearn.data.oops": str(bad / "oops.py"), "chatlearn.runtime.cluster.launch": ""}
    found = [name for name, _, _ in imports(files["chatlearn.data.oops"], set(files))]
    assert found == ["chatlearn.runtime.cluster.launch"]
    assert layer_of("chatlearn.runtime.cluster.launch") > layer_of("chatlearn.data.oops")
    # and inside the runtime: the driver's waits asking the cluster's head watch would be a loop of parts
    assert layer_of("chatlearn.runtime.cluster.head", RUNTIME_LAYERS) > layer_of("chatlearn.runtime.calls.waiting",
                                                                                RUNTIME_LAYERS)


def test_stage_tasks_and_the_episode_take_the_run_context_not_the_config():
    import inspect

    from chatlearn.config import ChatLearnConfig
    from flows import episode_flow, stage_tasks

    tasks = [stage_tasks.generate, stage_tasks.score, stage_tasks.train, stage_tasks.sync, stage_tasks.checkpoint,
             stage_tasks.evaluate, episode_flow]
    for t in tasks:
        params = inspect.signature(t.fn).parameters.values()
        assert all(p.annotation is not ChatLearnConfig for p in params), t.name
        assert next(iter(params)).name == "ctx", t.name


def deadline_free_gets(path: str) -> list[int]:
    """Lines of ``ray.get(...)`` calls without a ``timeout=``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"
                  and not any(k.arg == "timeout" for k in node.keywords))


def test_the_driver_never_waits_without_a_deadline(tmp_path):
    # one way to wait: chatlearn.runtime.calls.waiting (deadline + stop check); anything else names its timeout
    found = [f"{os.path.relpath(p, REPO)}:{line}" for p in module_files().values() for line in deadline_free_gets(p)]
    assert found == []
    probe = tmp_path / "probe.py"  # the checker itself
    probe.write_text("import ray\nray.get(a)\nray.get(b, timeout=3)\nx.get(c)\n")
    assert deadline_free_gets(str(probe)) == [2]
