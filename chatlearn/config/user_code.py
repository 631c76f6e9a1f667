"""The user's own code a config names (reward functions, hooks, module classes) and where it is found.

Besides the installed packages, code is looked up in the current directory, the config file's folder and the
folders of file-form hooks (``path/to/myreward.py:fn``), in that order (`chatlearn.utils.imports`). The
driver looks there while `user_code(cfg)` is active (the checks, building the modules, the run); the Ray
workers get the same folders on their ``PYTHONPATH`` (`chatlearn.runtime.cluster.launch.ray_runtime_env`) and, when
the run joins a cluster whose other nodes do not share this file system, the files themselves as Ray
``py_modules`` (`shipped_code`).
"""

import contextlib
import importlib.metadata
import os
from collections.abc import Iterator
from typing import Any

from chatlearn.config.root import ChatLearnConfig
from chatlearn.utils.imports import CODE_PATH_VAR, code_dirs, file_source, is_file_form, module_source


def config_dir(cfg: ChatLearnConfig) -> str | None:
    """The main config file's folder (the loader records it on every model), None for a config built in code."""
    return next((m.config_dir for m in cfg.models.values() if m.config_dir), None)


# Every config field that names code to import or packages to install, as dotted paths (``*``: any model name,
# any key): the engine (``runtime.engine`` may be ``module:Class``), the relay and eval hooks, each model's module
# class and reward function, and the Ray runtime env (pip packages, py_modules, working_dir, ...). What a
# deployment pins (`flows.pins`); `hook_specs` imports from these and no other field.
CODE_FIELDS = ("runtime.engine", "runtime.relay_sample_fn", "runtime.eval_post_process_fn", "runtime.agent.env",
               "runtime.agent.env_args.factory", "models.*.args_dict.module", "models.*.args_dict.reward_fn",
               "runtime_env.*")


def code_fields(cfg: ChatLearnConfig) -> dict[str, Any]:
    """The values of CODE_FIELDS in ``cfg`` (JSON), by dotted path: every model's own, runtime_env key by key;
    a field the config does not set is None."""
    data = cfg.model_dump(mode="json")
    out: dict[str, Any] = {}
    for pattern in CODE_FIELDS:
        level: list[tuple[str, Any]] = [("", data)]
        for part in pattern.split("."):
            nxt = []
            for prefix, node in level:
                node = node if isinstance(node, dict) else {}
                keys = list(node) if part == "*" else [part]
                nxt += [(f"{prefix}.{key}" if prefix else key, node.get(key)) for key in keys]
            level = nxt
        out.update(level)
    return out


def hook_specs(cfg: ChatLearnConfig) -> list[str]:
    """Every ``module:name`` the config names: module classes, reward functions, the relay and eval hooks, an
    engine class of one's own (CODE_FIELDS but the runtime env)."""
    specs = [v for path, v in code_fields(cfg).items() if not path.startswith("runtime_env.")]
    return [s for s in dict.fromkeys(specs) if isinstance(s, str) and ":" in s]


def user_code_dirs(cfg: ChatLearnConfig) -> list[str]:
    """The code folders of this config besides the current directory: the config's folder, then the folder of
    each file-form hook."""
    base = [d for d in [config_dir(cfg)] if d]
    search = list(dict.fromkeys([os.getcwd(), *base]))
    modules = [spec.rsplit(":", 1)[0] for spec in hook_specs(cfg)]
    files = [file_source(m, search) for m in modules if is_file_form(m)]
    return list(dict.fromkeys([os.path.abspath(d) for d in base] + [os.path.dirname(f) for f in files if f]))


@contextlib.contextmanager
def user_code(cfg: ChatLearnConfig) -> Iterator[list[str]]:
    """While the block runs, this process looks up user code in the config's code folders too (yields all the
    folders, the current directory first)."""
    saved = os.environ.get(CODE_PATH_VAR)
    extra = [d for d in user_code_dirs(cfg) if d not in (saved or "").split(os.pathsep)]
    if extra:
        os.environ[CODE_PATH_VAR] = os.pathsep.join([*extra, *([saved] if saved else [])])
    try:
        yield code_dirs()
    finally:
        if saved is None:
            os.environ.pop(CODE_PATH_VAR, None)
        else:
            os.environ[CODE_PATH_VAR] = saved


def shipped_code(cfg: ChatLearnConfig) -> list[str]:
    """The files and package folders of the hooks that come from the code folders, not from an installed
    distribution: what a cluster's other nodes need as Ray ``py_modules``."""
    installed = importlib.metadata.packages_distributions()
    with user_code(cfg) as dirs:
        found = []
        for spec in hook_specs(cfg):
            module_part = spec.rsplit(":", 1)[0]
            top = module_part.split(".")[0]
            if is_file_form(module_part):
                found.append(file_source(module_part, dirs))
            elif top not in installed:
                found.append(module_source(top, dirs))
    return list(dict.fromkeys(f for f in found if f))
