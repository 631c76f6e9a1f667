"""The import graph of `chatlearn/` and `flows/`: layers import downward only, and nothing imports in a loop.

Layers, lowest first (a module may import its own layer and the ones below):

    chatlearn.utils            helpers with no project imports
    chatlearn.config           the config: schema, loader, checks (and ChatLearn's path to it, which
                               chatlearn/__init__.py registers as chatlearn.utils.arguments)
    data, checkpoint, tools    batches and records, checkpoints, tool calls
    algorithms, envs           the RL math over batches; multi-turn environments (which call tools)
    chatlearn.tasks            the packaged tasks: data, rewards, environments
    chatlearn.models           ChatLearn's module API and the built-in Hugging Face modules
    chatlearn.runtime          actors, model groups, launch, plan, engines
    chatlearn                  the package's face
    flows                      Prefect flows and tasks
    chatlearn.cli              the command: it starts runs and registers the flows as deployments

Packages listed in one layer do not import each other either (a sideways import is a layer the list does not
show). Inside `chatlearn.runtime` the same rules hold between its parts, lowest first (`RUNTIME_LAYERS`): what
the engines' flows compile into, how the driver calls and waits, weight transfer, Prefect's room and what a run
records, the cluster's processes, the run's spec and context, the rollout strategies, and what starts and runs
a run.

The one upward arrow allowed: `chatlearn.runtime.engine` imports `flows.train_flow` / `flows.eval_flow`
inside `learn()` / `eval()`, because ChatLearn's API starts a run from the engine (documented there).
An import inside a function is allowed only with a comment saying why (on it or just above its block).

Prefect's and Ray's internals each live in one room: only `chatlearn.runtime.prefect` goes beyond Prefect's and
prefect-ray's public API, only `chatlearn.runtime.cluster.ray_private` beyond Ray's (their private modules and
`_`-names, private attributes of their objects, their logger names, patching their classes), so an upgrade is
ported there, guided by `tests/test_private_api_pins.py`.
"""

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict

from tests.conftest import REPO

LAYERS = [
    ["chatlearn.utils"],
    ["chatlearn.config"],
    ["chatlearn.data", "chatlearn.checkpoint", "chatlearn.tools"],
    ["chatlearn.algorithms", "chatlearn.envs"],
    ["chatlearn.tasks"],
    ["chatlearn.models"],
    ["chatlearn.runtime"],
    ["chatlearn"],
    ["flows"],
    ["chatlearn.cli"],
]
RUNTIME_LAYERS = [
    ["chatlearn.runtime.compute_flow"],
    ["chatlearn.runtime.plan", "chatlearn.runtime.schedule"],
    ["chatlearn.runtime.calls"],
    ["chatlearn.runtime.weights"],
    # Prefect's room holds what goes beyond Prefect's public API whatever its level: the API link every record
    # goes through sits below the records, the prevalidated flow that prepares a run near the top
    ["chatlearn.runtime.prefect"],
    ["chatlearn.runtime.records"],
    ["chatlearn.runtime.cluster"],
    ["chatlearn.runtime.spec"],
    ["chatlearn.runtime.context"],
    ["chatlearn.runtime.rollout"],
    ["chatlearn.runtime.engines"],
    ["chatlearn.runtime.prepared"],
    ["chatlearn.runtime.launch", "chatlearn.runtime.episodes", "chatlearn.runtime.prefect.prevalidated"],
    ["chatlearn.runtime.engine", "chatlearn.runtime"],
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


def place_of(module: str, layers: list[list[str]] = LAYERS) -> tuple[int, str]:
    """The layer of ``module`` and the package of ``layers`` it belongs to (the longest prefix that matches)."""
    best, level = "", -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    assert level >= 0, f"{module} is in no layer: add it to the layers"
    return level, best


def layer_of(module: str, layers: list[list[str]] = LAYERS) -> int:
    return place_of(module, layers)[0]


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


def sideways(edges: dict[str, set[str]], layers: list[list[str]] = LAYERS) -> list[tuple[str, str]]:
    """Imports between two packages that ``layers`` lists in the same layer."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if layer_of(a, layers) == layer_of(b, layers) and place_of(a, layers)[1] != place_of(b, layers)[1])


def test_packages_of_one_layer_do_not_import_each_other():
    assert sideways(graph()) == []


def test_the_runtimes_parts_import_downward_only():
    # a loop between two sub-packages is no loop of modules (test_no_import_loops cannot see it): the runtime's
    # parts have an order of their own
    runtime = {m for m in module_files() if m.startswith("chatlearn.runtime")}
    edges = {a: {b for b in targets if b in runtime} for a, targets in graph().items() if a in runtime}
    upward = sorted((a, b) for a, targets in edges.items() for b in targets
                    if layer_of(b, RUNTIME_LAYERS) > layer_of(a, RUNTIME_LAYERS))
    assert upward == []
    assert sideways(edges, RUNTIME_LAYERS) == []


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
    # and a sideways one (the RL math importing an environment), not one inside a package; the batch layout
    # (chatlearn.data.batch's loss_mask) is below the math that reads it
    edges = {"chatlearn.algorithms.ppo": {"chatlearn.envs.base", "chatlearn.algorithms.registry"}}
    assert sideways(edges) == [("chatlearn.algorithms.ppo", "chatlearn.envs.base")]
    assert layer_of("chatlearn.data.batch") < layer_of("chatlearn.algorithms.ppo")
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


# The rooms of the libraries' internals (see the module docstring), and the private names they use, from their
# tables: outside its room, such a name is a private use even where the checker cannot tell the object's type.
ROOMS = {"prefect": "chatlearn.runtime.prefect", "prefect_ray": "chatlearn.runtime.prefect",
         "ray": "chatlearn.runtime.cluster.ray_private"}
ROOM_TABLES = ["chatlearn/runtime/prefect/__init__.py", "chatlearn/runtime/cluster/ray_private.py"]


def known_private_names() -> dict[str, str]:
    """``{private name: library}`` for each `_`-name in the rooms' ``PRIVATE_USES`` (read from their source)."""
    names: dict[str, str] = {}
    for table in ROOM_TABLES:
        tree = ast.parse(open(os.path.join(REPO, table), encoding="utf-8").read())
        rows = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name) and node.target.id == "PRIVATE_USES")
        for uses, _ in rows:
            uses = uses.removeprefix("logger ")
            words = re.findall(r"[A-Za-z_]\w*", uses)
            for word in words:
                if word.startswith("_") and word not in ("__init__", "__call__"):
                    names[word] = words[0]
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _root(node: ast.AST) -> str | None:
    """The name an expression such as ``a.b().c[0].d`` starts from."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: str, known: dict[str, str]) -> list[tuple[str, int, str]]:
    """(library, line, what) for each use of Prefect's, prefect-ray's or Ray's private API in the file: a private
    module or a `_`-name imported from one; a `_`-attribute read on a name imported from one (``ray._private``,
    ``RayTaskRunner._run_prefect_task``), on a class of theirs by a subclass (``self._started``), or, for a name
    of the rooms' tables, on anything; a `_`-keyword passed to their functions; their classes or modules patched
    (an attribute assigned, ``setattr``); a string naming one of their private modules or loggers
    (``"prefect._internal"``) or a private name of the tables (``getattr(x, "_max_workers")``)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found: list[tuple[str, int, str]] = []
    bound: dict[str, str] = {}  # a name imported from one of the libraries -> the library
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                lib = alias.name.split(".")[0]
                if lib in ROOMS:
                    bound[alias.asname or lib] = lib
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append((lib, node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            lib = node.module.split(".")[0]
            if lib not in ROOMS:
                continue
            for alias in node.names:
                bound[alias.asname or alias.name] = lib
                if any(_private(part) for part in node.module.split(".")) or _private(alias.name):
                    found.append((lib, node.lineno, f"imports {node.module}.{alias.name}"))
    docstrings = _docstrings(tree)
    private_string = re.compile(rf"^({'|'.join(ROOMS)})(\.\w+)*\._")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            lib = bound.get(_root(node.value) or "")
            if lib is not None and (_private(node.attr) or node.attr in known):
                found.append((lib, node.lineno, f"reads {ast.unparse(node)}"))
            elif node.attr in known and _root(node.value) not in ("self", "cls"):
                found.append((known[node.attr], node.lineno, f"reads {ast.unparse(node)}"))
        elif isinstance(node, ast.Call):
            lib = bound.get(_root(node.func) or "")
            if lib is not None:
                found += [(lib, node.lineno, f"passes {k.arg}= to {ast.unparse(node.func)}")
                          for k in node.keywords if k.arg and _private(k.arg)]
            if isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
                lib = bound.get(_root(node.args[0]) or "")
                if lib is not None:
                    found.append((lib, node.lineno, f"patches {ast.unparse(node.args[0])}"))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                lib = bound.get(_root(target) or "") if isinstance(target, ast.Attribute) else None
                if lib is not None:
                    found.append((lib, node.lineno, f"patches {ast.unparse(target)}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = private_string.match(node.value)
            if match or node.value in known:
                found.append((match.group(1) if match else known[node.value], node.lineno, f"names {node.value!r}"))
        elif isinstance(node, ast.ClassDef):
            libs = {bound.get(_root(base) or "") for base in node.bases} - {None}
            own = {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign | ast.AnnAssign)
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                   if isinstance(t, ast.Attribute) and _root(t) == "self"}
            found += [(lib, n.lineno, f"{node.name} reads its base's {ast.unparse(n)}") for lib in libs
                      for n in ast.walk(node) if isinstance(n, ast.Attribute) and _root(n) in ("self", "cls")
                      and isinstance(n.value, ast.Name) and _private(n.attr) and n.attr not in own]
    return found


def _outside_its_room(module: str, lib: str) -> bool:
    room = ROOMS[lib]
    return not (module == room or module.startswith(room + "."))


def test_prefect_and_ray_internals_stay_in_their_rooms():
    known = known_private_names()
    bench = {f"bench.{name[:-3]}": os.path.join(REPO, "bench", name) for name in os.listdir(os.path.join(REPO, "bench"))
             if name.endswith(".py")}
    found = [f"{os.path.relpath(path, REPO)}:{line} {what} ({lib}'s private API belongs in {ROOMS[lib]})"
             for mod, path in sorted({**module_files(), **bench}.items())
             for lib, line, what in private_uses(path, known) if _outside_its_room(mod, lib)]
    assert found == []


def test_the_rooms_hold_the_private_uses_their_tables_name():
    # the tables are the rooms' own: each names something the room uses, so the list of known names is real
    known = known_private_names()
    assert {"_create_task_run_locally", "_max_workers", "_run_prefect_task", "_global_node", "_node_ip_address",
            "__var__"} <= set(known)
    used = {what for mod, path in module_files().items() for lib, _, what in private_uses(path, known)
            if not _outside_its_room(mod, lib)}
    assert any("_create_task_run_locally" in w for w in used) and any("_global_node" in w for w in used)


def test_the_room_test_sees_a_planted_private_use(tmp_path):
    # the checker itself: each way of going beyond the public API, outside a room, is reported
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import logging\n"
        "import ray\n"
        "from prefect._internal.engine import resolve_custom_task_run_name\n"
        "from prefect.task_engine import _create_task_run_locally\n"
        "from prefect.task_runners import ThreadPoolTaskRunner\n"
        "from prefect_ray import RayTaskRunner\n"
        "node = ray._private.worker._global_node\n"
        "workers = runner._max_workers\n"
        "workers = getattr(runner, '_max_workers')\n"
        "logging.getLogger('prefect._internal')\n"
        "RayTaskRunner.submit = None\n"
        "ray.init(_node_ip_address='10.0.0.1')\n"
        "class Pool(ThreadPoolTaskRunner):\n"
        "    def submit(self):\n"
        "        self._mine = 1\n"
        "        return self._executor, self._mine\n"
        "ray.get(ref, timeout=1)\n"
        "self._executor = None\n")
    known = known_private_names()
    assert sorted((line, lib, what) for lib, line, what in private_uses(str(probe), known)) == [
        (3, "prefect", "imports prefect._internal.engine.resolve_custom_task_run_name"),
        (4, "prefect", "imports prefect.task_engine._create_task_run_locally"),
        (7, "ray", "reads ray._private"), (7, "ray", "reads ray._private.worker._global_node"),
        (8, "prefect", "reads runner._max_workers"), (9, "prefect", "names '_max_workers'"),
        (10, "prefect", "names 'prefect._internal'"), (11, "prefect_ray", "patches RayTaskRunner.submit"),
        (12, "ray", "passes _node_ip_address= to ray.init"), (16, "prefect", "Pool reads its base's self._executor")]
    assert _outside_its_room("chatlearn.runtime.records.reporting", "prefect")
    assert not _outside_its_room("chatlearn.runtime.prefect.task_runs", "prefect")
    assert _outside_its_room("chatlearn.runtime.prefect.task_runs", "ray")


def test_chatlearns_path_to_the_config_imports_in_a_fresh_interpreter():
    # chatlearn.utils.arguments has no file under utils/ (utils sits below the config): chatlearn/__init__.py
    # registers chatlearn.config.arguments under that name, and importing the path runs it first
    code = ("from chatlearn.utils.arguments import ModelConfig\n"
            "import chatlearn.utils.arguments, chatlearn.config.arguments\n"
            "from chatlearn.utils import arguments\n"
            "print(chatlearn.utils.arguments is chatlearn.config.arguments is arguments, ModelConfig.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (out.returncode, out.stdout.strip()) == (0, "True chatlearn.config.model"), out.stderr
    assert not os.path.exists(os.path.join(REPO, "chatlearn", "utils", "arguments.py"))
