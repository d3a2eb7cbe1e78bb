"""The generated Kubernetes base (layerwatch/deploy/kubernetes/): valid against the Kubernetes schemas and the
Prometheus Operator's CRD schemas, its rules pass promtool, and its pieces fit together.

The CRD schemas in data/prometheus-operator-crds/ are the `openAPIV3Schema` of the v1 version of
example/prometheus-operator-crd/monitoring.coreos.com_{podmonitors,prometheusrules}.yaml in the
prometheus-operator repository, release 0.93.0 (the CRDs kube-prometheus-stack installs).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from layerwatch import ports
from layerwatch.cli.main import build_parser
from layerwatch.deploy import manifests, vllm
from layerwatch.mixin import config

from .conftest import REPO, run_tool

BASE = REPO / manifests.DIRECTORY
CRD_SCHEMAS = Path(__file__).parent / "data" / "prometheus-operator-crds"
KUBERNETES_VERSION = "1.33.0"  # validated against; the base uses only long-stable fields


VLLM_VARIANT = REPO / manifests.VLLM_DIRECTORY


def load_resources(directory: Path = BASE) -> dict[str, dict]:
    """kind -> resource, in the order the kustomization lists them."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources = [yaml.safe_load((directory / name).read_text()) for name in kustomization["resources"]]
    listed = {path.name for path in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(kustomization["resources"]), "every file of the base is a listed resource"
    return {resource["kind"]: resource for resource in resources}


RESOURCES = load_resources()
VLLM_RESOURCES = load_resources(VLLM_VARIANT)
CORE_KINDS = ("Deployment", "Service", "ConfigMap")
OPERATOR_KINDS = ("PodMonitor", "PrometheusRule")


def test_the_base_holds_the_shim_with_its_exporter_monitoring_rules_and_dashboards():
    assert set(RESOURCES) == {*CORE_KINDS, *OPERATOR_KINDS}


@pytest.mark.parametrize("resources", [RESOURCES, VLLM_RESOURCES], ids=["base", "vllm"])
@pytest.mark.parametrize("kind", CORE_KINDS)
def test_core_resources_are_valid_kubernetes(kind, resources):
    kubernetes_validate.validate(resources[kind], KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_validation_has_teeth():
    broken = copy.deepcopy(RESOURCES["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def operator_validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((CRD_SCHEMAS / f"{kind}.json").read_text()))


@pytest.mark.parametrize("resources", [RESOURCES, VLLM_RESOURCES], ids=["base", "vllm"])
@pytest.mark.parametrize("kind", OPERATOR_KINDS)
def test_operator_resources_match_the_crd_schemas(kind, resources):
    errors = [error.message for error in operator_validator(kind).iter_errors(resources[kind])]
    assert not errors


def test_the_crd_validation_has_teeth():
    broken = copy.deepcopy(RESOURCES["PodMonitor"])
    broken["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "rewrite"
    assert list(operator_validator("PodMonitor").iter_errors(broken))


def test_the_prometheus_rule_carries_the_generated_rules_and_promtool_accepts_them(promtool, tmp_path):
    groups = RESOURCES["PrometheusRule"]["spec"]
    assert groups == yaml.safe_load((REPO / "layerwatch/alerts/generated/layerwatch.rules.yaml").read_text())
    rules = tmp_path / "from-prometheusrule.yaml"
    rules.write_text(yaml.safe_dump(groups))
    result = run_tool(promtool, "check", "rules", rules)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_config_map_carries_the_dashboard_for_grafanas_sidecar():
    config_map = RESOURCES["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"overview.json": (REPO / "layerwatch/dashboards/json/overview.json").read_text()}
    # `kubectl apply` keeps the whole object in an annotation limited to 256 KiB.
    assert len(json.dumps(config_map)) < 256 * 1024


def containers() -> dict[str, dict]:
    pod = RESOURCES["Deployment"]["spec"]["template"]["spec"]
    return {container["name"]: container for container in pod["containers"]}


def parsed_arguments(container: dict):
    argv = container["args"]
    assert argv[0] == "layerwatch"
    return build_parser(argv[1:], environ={}).parse_args(argv[1:])


def test_frames_stay_on_the_pods_loopback():
    shim, exporter = parsed_arguments(containers()["shim"]), parsed_arguments(containers()["exporter"])
    frames = (ports.LOOPBACK, ports.EXPORTER_FRAMES_PORT)
    assert exporter.listen == frames  # not reachable from outside the pod
    assert shim.exporter_address == f"{ports.LOOPBACK}:{ports.EXPORTER_FRAMES_PORT}"
    assert shim.port == ports.SHIM_HTTP_PORT and exporter.http == ("0.0.0.0", ports.EXPORTER_HTTP_PORT)


def test_probes_monitors_and_service_point_at_declared_ports_and_labels():
    deployment = RESOURCES["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {port["name"] for c in containers().values() for port in c["ports"]}
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        RESOURCES["Service"]["spec"]["selector"],
        RESOURCES["PodMonitor"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= pod_labels.items()
    for container in containers().values():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in port_names
    assert containers()["shim"]["readinessProbe"]["httpGet"]["path"] == "/readyz"  # a real generation
    endpoints = RESOURCES["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} <= port_names
    jobs = {e["relabelings"][0]["replacement"] for e in endpoints}
    assert jobs == {config.SHIM_JOB, config.EXPORTER_JOB}  # what every rule and panel selects on
    assert {p["targetPort"] for p in RESOURCES["Service"]["spec"]["ports"]} <= port_names


def test_the_shim_asks_for_a_gpu_and_images_match_the_compose_stack():
    shim, exporter = containers()["shim"], containers()["exporter"]
    assert shim["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "LAYERWATCH_DEVICE", "value": "cuda"} in shim["env"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert shim["image"] == compose["shim"]["image"] and exporter["image"] == compose["exporter"]["image"]


def test_a_busy_replica_stays_ready_and_the_exporter_cannot_unready_the_pod():
    from layerwatch.inference_shim.service.readiness import PROBE_TIMEOUT_SECONDS

    # /readyz may wait behind a full batch for PROBE_TIMEOUT_SECONDS: the kubelet must wait longer, or
    # every saturated replica leaves the Service at once.
    assert containers()["shim"]["readinessProbe"]["timeoutSeconds"] > PROBE_TIMEOUT_SECONDS
    # A pod is Ready only when every container is: the sidecar has liveness, no readiness.
    assert "readinessProbe" not in containers()["exporter"] and "livenessProbe" in containers()["exporter"]


# --- the vLLM variant -----------------------------------------------------------------------------


def vllm_containers() -> dict[str, dict]:
    pod = VLLM_RESOURCES["Deployment"]["spec"]["template"]["spec"]
    return {container["name"]: container for container in pod["containers"]}


def test_the_vllm_variant_runs_vllm_with_the_plugin_and_the_exporter_and_guard_beside_it():
    assert set(vllm_containers()) == {"vllm", "exporter", "vllm-guard"}
    assert vllm_containers()["exporter"] == containers()["exporter"]  # the base's sidecar, unchanged
    frames = f"{ports.LOOPBACK}:{ports.EXPORTER_FRAMES_PORT}"
    assert vllm_containers()["vllm"]["args"] == vllm.serve_args(frames)  # frames stay on the pod's loopback
    overrides = json.loads(vllm_containers()["vllm"]["args"][-1])
    assert overrides["architectures"] == [vllm.ARCHITECTURE]
    assert overrides["layerwatch"]["model_name"] == config.VLLM_SERVED_MODEL_NAME
    assert vllm_containers()["vllm"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    guard = vllm_containers()["vllm-guard"]["args"]
    assert guard[guard.index("--upstream") + 1] == f"http://{ports.LOOPBACK}:{ports.VLLM_HTTP_PORT}"
    assert guard[guard.index("--served-model-name") + 1] == config.VLLM_SERVED_MODEL_NAME
    assert vllm_containers()["vllm-guard"]["image"] == vllm_containers()["exporter"]["image"]


def test_vllm_outlives_the_guards_drain_within_the_pods_grace_period():
    """Both get SIGTERM at once but for vLLM's preStop: the guard's drain then reaches a vLLM still serving."""
    drain = build_parser(["vllm-guard"]).parse_args(["vllm-guard", "--served-model-name", "m"]).drain_timeout_seconds
    command = vllm_containers()["vllm"]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and float(command[1]) > drain
    grace = VLLM_RESOURCES["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(command[1])


def test_the_vllm_variant_shares_the_monitoring_and_keeps_its_own_names():
    """The same PrometheusRule and dashboard ConfigMap under the same names (applying the variant beside the
    base changes neither), and its own Deployment, Service and PodMonitor (it replaces none of the base's)."""
    for kind in ("PrometheusRule", "ConfigMap"):
        assert VLLM_RESOURCES[kind] == RESOURCES[kind]
    for kind in ("Deployment", "Service", "PodMonitor"):
        assert VLLM_RESOURCES[kind]["metadata"]["name"] != RESOURCES[kind]["metadata"]["name"]


def test_the_vllm_variants_probes_monitor_and_service_point_at_declared_ports_and_labels():
    deployment = VLLM_RESOURCES["Deployment"]
    pod = deployment["spec"]["template"]
    port_names = {port["name"] for c in vllm_containers().values() for port in c["ports"]}
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        VLLM_RESOURCES["Service"]["spec"]["selector"],
        VLLM_RESOURCES["PodMonitor"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod["metadata"]["labels"].items()
        # The base's pods are not selected, nor the variant's by the base.
        assert not selector.items() <= RESOURCES["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    for container in vllm_containers().values():
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["port"] in port_names
    volumes = {volume["name"] for volume in pod["spec"]["volumes"]}
    assert {mount["name"] for mount in vllm_containers()["vllm"]["volumeMounts"]} <= volumes
    endpoints = VLLM_RESOURCES["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} <= port_names
    jobs = {e["relabelings"][0]["replacement"] for e in endpoints}
    assert jobs == {config.VLLM_JOB, config.EXPORTER_JOB, config.VLLM_GUARD_JOB}
    assert {p["targetPort"] for p in VLLM_RESOURCES["Service"]["spec"]["ports"]} <= port_names
