"""Settings are resolved once per process, with one precedence rule, and nothing else reads the environment."""

import re
from pathlib import Path

import pytest

from kuberl.runconfig import load_run_config, write_run_config
from kuberl.settings import RUN_CONFIG_FIELDS, Settings, resolve

from .conftest import ROOT

ENV_READ = re.compile(r"os\.environ\s*(\.get|\[|\.copy|\))|os\.getenv|\*\*os\.environ|in os\.environ|environ\.items")


def test_the_run_config_section_wins_over_the_environment_which_wins_over_the_defaults():
    env = {"POD_IP": "10.0.0.7", "KUBERL_THREADS": "4", "MASTER_ADDR": "t-n0.t", "KUBERL_S3_ENDPOINT": "",
           "KUBERL_API_TOKEN": "x" * 32}
    settings = resolve(env, {"max_steps": 12, "tensorboard_dir": "/w/tb", "inference_urls": ["http://a:1"]})
    assert (settings.bind_host, settings.threads, settings.master_addr) == ("10.0.0.7", 4, "t-n0.t")
    assert settings.s3_endpoint is None  # an empty variable counts as unset
    assert (settings.max_steps, settings.tensorboard_dir, settings.inference_urls) == (12, Path("/w/tb"),
                                                                                       ("http://a:1",))
    assert settings.progress_port == 8080 and settings.staging_dir == Path("/tmp/kuberl-staging")
    assert "x" * 32 not in repr(settings)  # tokens never reach a log line through repr


def test_the_rollout_process_cores_are_integers_from_yaml_or_text():
    assert resolve({}, {"rollout_cores": [0, 1]}).rollout_cores == (0, 1)
    assert resolve({}, {"rollout_cores": "2,3"}).rollout_cores == (2, 3)
    assert resolve({}, {}).rollout_cores == ()


def test_the_exchange_store_is_rank_0_one_port_above_the_rendezvous_unless_the_pod_is_told_otherwise():
    assert resolve({"MASTER_ADDR": "t-n0.t", "MASTER_PORT": "29600"}).exchange_address == ("t-n0.t", 29601)
    told = resolve({"KUBERL_EXCHANGE_ADDR": "t-n0.t.ns.svc", "KUBERL_EXCHANGE_PORT": "29501"})
    assert told.exchange_address == ("t-n0.t.ns.svc", 29501)


@pytest.mark.parametrize(("env", "section", "named"), [
    ({"KUBERL_THREADS": "many"}, {}, "threads"),
    ({}, {"max_steps": "ten"}, "max_steps"),
    ({}, {"bind_host": "0.0.0.0"}, "bind_host"),  # the pod's own facts never come from the run config
    ({}, {"rollout_cores": ["0", "one"]}, "rollout_cores"),
])
def test_a_bad_setting_is_refused_naming_it(env, section, named):
    with pytest.raises(ValueError, match=named):
        resolve(env, section)


def test_a_local_runs_settings_travel_in_the_run_config(tmp_path):
    import yaml

    from kuberl.api.spec import RLExperimentSpec

    doc = yaml.safe_load((ROOT / "examples/cpu-tiny.yaml").read_text())
    section = {"checkpoint_uri": "file:///w/c/", "max_steps": 3, "weights_dir": tmp_path / "w", "progress_port": 9}
    path = write_run_config(tmp_path / "run.yaml", "e", RLExperimentSpec.model_validate(doc["spec"]), "r", section)
    settings = resolve({}, load_run_config(path).settings)
    assert (settings.checkpoint_uri, settings.max_steps, settings.weights_dir, settings.progress_port) == \
        ("file:///w/c/", 3, tmp_path / "w", 9)
    assert set(section) <= set(RUN_CONFIG_FIELDS)


@pytest.mark.parametrize("package", ["workload/kuberl", "operator/kuberl_operator"])
def test_outside_the_settings_module_and_the_entry_points_nothing_reads_the_environment(package):
    """The workload's ``kuberl.settings`` and the operator's ``kuberl_operator.settings`` are the only readers."""
    package = ROOT / package
    allowed = {package / "settings.py", *package.rglob("__main__.py")}
    readers = [f"{path.relative_to(ROOT)}:{n}" for path in sorted(package.rglob("*.py")) if path not in allowed
               for n, line in enumerate(path.read_text().splitlines(), 1) if ENV_READ.search(line)]
    assert readers == [], f"read the environment through the package's settings module instead: {readers}"


def test_the_defaults_are_a_bare_process_next_to_trainer_rank_0():
    assert Settings().exchange_address == ("127.0.0.1", 29501) and Settings().bind_host == ""
