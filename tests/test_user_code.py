"""The user's own code named in a config resolves from the current directory, the config's folder and the
file form `path/to/file.py:function`, without PYTHONPATH; an import error says where it looked.
(The real run from a folder outside the repository, with Ray workers importing the same hooks, is in
tests/test_outside_repo.py.)"""

import os
import sys

import pytest

from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.config.user_code import user_code, user_code_dirs
from chatlearn.utils.imports import import_callable, import_object

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def clean_imports(monkeypatch):
    """Whatever a test imports from its temporary folders is forgotten afterwards."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("CHATLEARN_CODE_PATH", raising=False)
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_module_in_the_current_directory_imports_with_its_neighbours(tmp_path, monkeypatch, clean_imports):
    write(tmp_path / "helpers_uc1.py", "BONUS = 0.25\n")
    write(tmp_path / "myreward_uc1.py", "from helpers_uc1 import BONUS\n\ndef fn(sample):\n    return BONUS\n")
    monkeypatch.chdir(tmp_path)
    assert import_callable("myreward_uc1:fn")({}) == 0.25
    # an installed module of the same name wins over a file in the folder (the folder is appended to sys.path)
    write(tmp_path / "yaml.py", "raise RuntimeError('the folder shadowed an installed package')\n")
    assert import_object("yaml:safe_load")("a: 1") == {"a": 1}


def test_the_config_folder_and_the_file_form(tmp_path, monkeypatch, clean_imports):
    conf = tmp_path / "project" / "conf"
    write(conf / "conf_reward_uc2.py", "def fn(sample):\n    return 0.5\n")
    write(tmp_path / "project" / "hooks" / "metrics_uc2.py", "def post(results, context):\n    return {'n': 1}\n")
    write(conf / "run.yaml", f"includes: [{REPO}/configs/grpo.yaml]\n"
                             "runtime:\n  eval_post_process_fn: hooks/metrics_uc2.py:post\n"
                             "models:\n  reward:\n    args_dict:\n      reward_fn: conf_reward_uc2:fn\n")
    monkeypatch.chdir(tmp_path / "project")
    with pytest.raises(ValueError, match="not installed, and no conf_reward_uc2.py or conf_reward_uc2/ in "):
        import_callable("conf_reward_uc2:fn")  # outside the run's lookup the config folder is unknown
    cfg = load_config("conf/run.yaml", checks=[EngineChecks()])  # the checks import both hooks
    assert user_code_dirs(cfg) == [str(conf), str(tmp_path / "project" / "hooks")]
    with user_code(cfg) as dirs:
        assert dirs == [str(tmp_path / "project"), str(conf), str(tmp_path / "project" / "hooks")]
        assert import_callable("conf_reward_uc2:fn")({}) == 0.5
        assert import_callable("hooks/metrics_uc2.py:post")([], {}) == {"n": 1}
        assert import_callable(f"{tmp_path}/project/hooks/metrics_uc2.py:post")([], {}) == {"n": 1}
        # the file form imports under the file's name, so its objects pickle by reference to the Ray workers
        assert import_callable("hooks/metrics_uc2.py:post").__module__ == "metrics_uc2"


def test_import_errors_say_where_they_looked(tmp_path, monkeypatch, clean_imports):
    conf = tmp_path / "conf"
    write(conf / "run.yaml", f"includes: [{REPO}/configs/grpo.yaml]\n")
    write(tmp_path / "broken_uc3.py", "import not_a_module_anywhere_uc3\n")
    write(tmp_path / "json.py", "x = 1\n")  # a file named like a module that is already imported elsewhere
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config("conf/run.yaml", ["models.reward.args_dict.reward_fn=myreward:fn",
                                      "runtime.eval_post_process_fn=hooks/nothere.py:post"], [EngineChecks()])
    problems = "\n".join(err.value.problems)
    assert (f"models.reward.args_dict.reward_fn: 'myreward:fn': cannot import module 'myreward': no module named "
            f"'myreward': not installed, and no myreward.py or myreward/ in {tmp_path} (the current directory), "
            f"{conf}") in problems
    assert (f"runtime.eval_post_process_fn: 'hooks/nothere.py:post': cannot import module 'hooks/nothere.py': "
            f"no file hooks/nothere.py in {tmp_path} (the current directory), {conf}") in problems
    # a module that imports something missing reports that, not where the module itself was looked for
    with pytest.raises(ValueError, match="No module named 'not_a_module_anywhere_uc3'"):
        import_callable("broken_uc3:fn")
    with pytest.raises(ValueError, match=r"json.py would be imported as module 'json', but another module of that "
                                         r"name is importable .*; rename the file"):
        import_callable("json.py:dumps")
    with pytest.raises(ValueError, match="not of the form module:attribute"):
        import_callable("a:b:c")


def test_a_misspelt_name_gets_the_nearest_one():
    with pytest.raises(ValueError) as err:
        import_object("chatlearn.tasks.max_digit:max_digit_rewrd")
    assert str(err.value) == ("'chatlearn.tasks.max_digit:max_digit_rewrd': 'chatlearn.tasks.max_digit' has no "
                              "attribute 'max_digit_rewrd'; did you mean max_digit_reward?")
    with pytest.raises(ValueError) as err:
        import_object("chatlearn.tasks.higher_lowr:HigherLower")
    assert str(err.value).endswith("No module named 'chatlearn.tasks.higher_lowr'; did you mean "
                                   "chatlearn.tasks.higher_lower?")
    with pytest.raises(ValueError) as err:  # nothing near: no guess
        import_object("chatlearn.tasks.max_digit:zzz")
    assert str(err.value) == "'chatlearn.tasks.max_digit:zzz': 'chatlearn.tasks.max_digit' has no attribute 'zzz'"
