"""What a deployment of a config holds, without a server: the config's own `deployment:` section (schedule,
overlap rule), the run form's defaults (paths made absolute) and the completion trigger of the eval."""

import os

import pytest

from chatlearn.config import ConfigError, load_config
from flows.deployments import deployment_spec, eval_trigger, form_defaults


def test_a_config_carries_its_own_schedule_and_overlap_rule(tmp_path):
    path = tmp_path / "nightly.yaml"
    path.write_text(f"includes: [{os.path.abspath('configs/default.yaml')}]\n"
                    "deployment:\n  cron: '0 3 * * *'\n  timezone: Europe/Berlin\n  on_overlap: queue\n")
    cfg = load_config(str(path))
    spec = deployment_spec(cfg)
    assert (spec.name, spec.cron, spec.timezone, spec.on_overlap, spec.work_pool) == (
        "default", "0 3 * * *", "Europe/Berlin", "queue", "chatlearn")
    assert spec.concurrency().limit == 1 and spec.concurrency().collision_strategy.value == "ENQUEUE"
    (schedule,) = spec.schedule_kwargs()["schedules"]
    assert (schedule.cron, schedule.timezone) == ("0 3 * * *", "Europe/Berlin")
    # the command line's flags are overrides of the same section
    flagged = deployment_spec(load_config(str(path), ["deployment.on_overlap=skip", "deployment.name=n"]))
    assert (flagged.name, flagged.on_overlap, flagged.concurrency().collision_strategy.value) == (
        "n", "skip", "CANCEL_NEW")
    assert deployment_spec(load_config(None)).schedule_kwargs() == {}


def test_bad_deployment_values_are_named():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["deployment.cron=0 3 * *", "deployment.timezone=Mars/Olympus",
                           "deployment.on_overlap=both", "deployment.croon=1"])
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        "deployment.cron", "deployment.croon", "deployment.on_overlap", "deployment.timezone"]


def test_the_run_form_is_the_resolved_config_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml"),
                      ["runtime.output_dir=out", "models.policy.args_dict.model_path=models/tiny"])
    form = form_defaults(cfg)
    assert form["runtime"]["output_dir"] == str(tmp_path / "out" / "default")
    assert form["models"]["policy"]["args_dict"]["model_path"] == str(tmp_path / "models" / "tiny")
    assert all(os.path.isabs(p) for p in [form["runtime"]["data_path"]] + [form["runtime"]["eval_data_path"]])
    # the form, validated again from any directory (a worker's), is the same config
    monkeypatch.chdir("/")
    again = load_config(form)
    assert again.runtime.run_dir == str(tmp_path / "out" / "default")
    assert again.models["policy"].args_dict["tiny_model"] == cfg.models["policy"].args_dict["tiny_model"]


def test_the_eval_trigger_fires_on_completed_runs_of_one_deployment():
    trigger = eval_trigger("1234")
    assert trigger.expect == {"prefect.flow-run.Completed"}
    assert trigger.match_related.model_dump() == {"prefect.resource.id": "prefect.deployment.1234"}
    assert trigger.parameters == {"train_run": "{{ event.resource.id }}"}
