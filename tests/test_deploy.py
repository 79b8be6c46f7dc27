"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas
(kubernetes-validate ships them: no cluster, no network), and say what the
container really does: its image, ports, user, probes, admin key and metrics."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from opara_core.serving.admin_key import ADMIN_KEY_ENV
from opara_core.serving.launcher import REPO_ROOT, ServerConfig

DEPLOY = REPO_ROOT / "deploy"
MANIFESTS = ("deployment.yaml", "service.yaml", "hpa.yaml")
# the oldest Kubernetes still supported upstream when this was written, and the newest the validator knows
VERSIONS = ("1.33.0", kubernetes_validate.utils.latest_version())


def load(name: str) -> dict:
    (document,) = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    return document


@pytest.fixture(scope="module")
def pod() -> dict:
    return load("deployment.yaml")["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (only,) = pod["spec"]["containers"]
    return only


def test_every_manifest_is_listed():
    assert sorted(p.name for p in DEPLOY.glob("*.yaml")) == sorted([*MANIFESTS, "prometheus-adapter-values.yaml"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_validate_against_the_kubernetes_schema(name, version):
    """strict: an unknown or misspelt field fails too."""
    kubernetes_validate.validate(load(name), version, strict=True)


def test_the_validator_catches_a_misplaced_field():
    deployment = load("deployment.yaml")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def dockerfile() -> str:
    return (REPO_ROOT / "Dockerfile").read_text()


def test_the_image_is_the_one_the_readme_builds(container):
    tag = re.search(r"docker build -t (\S+) \.", (REPO_ROOT / "README.md").read_text()).group(1)
    assert container["image"].split(":")[0] == tag


def test_ports_are_the_launchers_and_the_images(container):
    defaults = ServerConfig()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": defaults.http_port, "grpc": defaults.grpc_port, "metrics": defaults.metrics_port}
    exposed = re.search(r"^EXPOSE (.*)$", dockerfile(), re.M).group(1).split()
    assert sorted(map(int, exposed)) == sorted(ports.values())
    service = load("service.yaml")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["selector"].items() <= load("deployment.yaml")["spec"]["template"]["metadata"]["labels"].items()


def readme_probes() -> dict[str, str]:
    """probe -> path, from the README's table of probes."""
    return dict(re.findall(r"^\| (liveness|readiness|startup) \| `(\S+)` \|", (REPO_ROOT / "README.md").read_text(), re.M))


def test_probes_ask_what_the_readme_documents(container):
    documented = readme_probes()
    assert set(documented) == {"liveness", "readiness", "startup"}
    for probe, path in documented.items():
        check = container[f"{probe}Probe"]["httpGet"]
        assert (check["path"], check["port"]) == (path, "http"), probe


def test_the_first_load_gets_as_long_as_the_images_healthcheck(container):
    start_period = int(re.search(r"--start-period=(\d+)s", dockerfile()).group(1))
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= start_period


def test_the_pod_runs_as_the_images_user_with_room_to_stop(pod):
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile()).group(1))
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid}
    assert pod["spec"]["terminationGracePeriodSeconds"] > ServerConfig().exit_timeout_s


def test_gpus_the_admin_key_shared_memory_and_metrics(pod, container):
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] >= 1
    (key,) = [e for e in container["env"] if e["name"] == ADMIN_KEY_ENV]
    assert set(key["valueFrom"]) == {"secretKeyRef"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (shm,) = [v for v in pod["spec"]["volumes"] if mounts.get(v["name"]) == "/dev/shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ServerConfig().metrics_port


def test_the_build_cache_outlives_the_pod_and_belongs_to_the_images_user(pod, container):
    from opara_core.engine.cache import ENV

    (cache_dir,) = [e["value"] for e in container["env"] if e["name"] == ENV]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[cache_dir]]
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"  # on the node: a restarted pod finds it
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile()).group(1))
    (owner,) = pod["spec"]["initContainers"]
    assert owner["command"] == ["chown", f"{uid}:{uid}", cache_dir] and owner["image"] == container["image"]
    assert {m["name"]: m["mountPath"] for m in owner["volumeMounts"]} == {mounts[cache_dir]: cache_dir}


def test_the_autoscaler_reads_the_metric_the_adapter_makes():
    hpa = load("hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == load("deployment.yaml")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"] and "nv_inference_request_success" in rule["metricsQuery"]
