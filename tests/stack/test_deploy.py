"""Deploy files: Prometheus and Alertmanager accept them, routing and inhibition do what
docs/alerting.md says (checked on a real Alertmanager), and the compose stack is valid."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from layerwatch import ports
from layerwatch.deploy import render as deploy
from layerwatch.deploy import vllm
from layerwatch.mixin import config
from tests.support import wait_for

from .conftest import REPO, require_binary, run_tool

COMMITTED_ALERTMANAGER = REPO / "layerwatch" / "deploy" / "alertmanager" / "alertmanager.yml"
COMPOSE_FILES = (REPO / "docker-compose.yml", REPO / "docker-compose.gpu.yml")


@pytest.fixture()
def stack(tmp_path: Path, reference_profiles) -> deploy.Stack:
    return deploy.render_stack(
        tmp_path,
        profiles=reference_profiles,
        shim_targets=["127.0.0.1:18000"],
        exporter_targets=["127.0.0.1:19411"],
        alertmanager_target="127.0.0.1:19093",
        pager_url="http://127.0.0.1:1/pager",
        ticket_url="http://127.0.0.1:1/ticket",
        scrape_interval=1,
        evaluation_interval=1,
        time_scale=0.01,
    )


def test_rendered_prometheus_config_is_valid_and_loads_only_the_rules(promtool: str, stack: deploy.Stack) -> None:
    result = run_tool(promtool, "check", "config", stack.prometheus_config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout
    cfg = yaml.safe_load(stack.prometheus_config.read_text())
    assert cfg["global"]["scrape_interval"] == "1s" and cfg["global"]["scrape_timeout"] == "1s"
    jobs = {s["job_name"]: s["static_configs"][0]["targets"] for s in cfg["scrape_configs"]}
    assert jobs == {config.SHIM_JOB: ["127.0.0.1:18000"], config.EXPORTER_JOB: ["127.0.0.1:19411"]}


def test_vllm_and_its_guard_are_scraped_as_their_own_jobs_when_asked_and_promtool_accepts_them(
    promtool: str, tmp_path: Path, reference_profiles
) -> None:
    rendered = deploy.render_stack(
        tmp_path,
        profiles=reference_profiles,
        shim_targets=["127.0.0.1:18000"],
        exporter_targets=["127.0.0.1:19411"],
        alertmanager_target="127.0.0.1:19093",
        pager_url="http://127.0.0.1:1/pager",
        ticket_url="http://127.0.0.1:1/ticket",
        vllm_targets=["127.0.0.1:18100"],
        vllm_guard_targets=["127.0.0.1:18102"],
    )
    result = run_tool(promtool, "check", "config", rendered.prometheus_config)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {s["job_name"]: s for s in yaml.safe_load(rendered.prometheus_config.read_text())["scrape_configs"]}
    assert jobs[config.VLLM_JOB]["static_configs"] == [{"targets": ["127.0.0.1:18100"]}]
    assert jobs[config.VLLM_GUARD_JOB]["static_configs"] == [{"targets": ["127.0.0.1:18102"]}]


def test_the_compose_prometheus_finds_the_optional_vllm_by_dns(promtool: str) -> None:
    """The committed prometheus.yml scrapes vLLM and its quality guard only where their names resolve: a stack
    started without `--profile vllm` has no target of either, hence no `up == 0` and no LayerwatchTargetDown."""
    committed = REPO / "layerwatch/deploy/prometheus/prometheus.yml"
    jobs = {s["job_name"]: s for s in yaml.safe_load(committed.read_text())["scrape_configs"]}
    assert jobs[config.VLLM_JOB] == {
        "job_name": config.VLLM_JOB,
        "dns_sd_configs": [{"names": [config.COMPOSE_VLLM_SERVICE], "type": "A", "port": ports.VLLM_HTTP_PORT}],
    }
    guard = [{"names": [config.COMPOSE_VLLM_GUARD_SERVICE], "type": "A", "port": ports.VLLM_GUARD_PORT}]
    assert jobs[config.VLLM_GUARD_JOB] == {"job_name": config.VLLM_GUARD_JOB, "dns_sd_configs": guard}
    result = run_tool(promtool, "check", "config", "--syntax-only", committed)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_stack_without_vllm_has_no_vllm_target_and_no_up_series_for_it(tmp_path: Path) -> None:
    """A real Prometheus on the committed scrape jobs (its scrape interval shortened): the compose services'
    names resolve nowhere here, so the static shim target is down (up == 0, what would page) while the vllm
    job, found by DNS, has no target and no `up` series at all."""
    committed = yaml.safe_load((REPO / "layerwatch/deploy/prometheus/prometheus.yml").read_text())
    fast = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": committed["scrape_configs"]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(fast))
    port = free_port()
    prometheus = subprocess.Popen(
        [
            require_binary("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def up_jobs() -> set[str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query=up", timeout=2) as response:
                samples = json.loads(response.read())["data"]["result"]
        except OSError:
            return None
        jobs = {sample["metric"]["job"] for sample in samples}
        return jobs if config.SHIM_JOB in jobs else None

    try:
        jobs = wait_for(up_jobs, timeout=30, interval=0.5, what="the shim's up series")
        time.sleep(2)  # two more scrape intervals for a vllm or guard target, were there one
        assert {config.VLLM_JOB, config.VLLM_GUARD_JOB}.isdisjoint(up_jobs() or jobs)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)


def test_remote_write_is_rendered_only_when_asked_and_promtool_accepts_it(
    promtool: str, tmp_path: Path, reference_profiles
) -> None:
    rendered = deploy.render_stack(
        tmp_path,
        profiles=reference_profiles,
        shim_targets=["127.0.0.1:18000"],
        exporter_targets=["127.0.0.1:19411"],
        alertmanager_target="127.0.0.1:19093",
        pager_url="http://127.0.0.1:1/pager",
        ticket_url="http://127.0.0.1:1/ticket",
        remote_write_urls=["http://127.0.0.1:8428/api/v1/write", "https://mimir.example/api/v1/push"],
    )
    result = run_tool(promtool, "check", "config", rendered.prometheus_config)
    assert result.returncode == 0, result.stdout + result.stderr
    cfg = yaml.safe_load(rendered.prometheus_config.read_text())
    assert cfg["remote_write"] == [
        {"url": "http://127.0.0.1:8428/api/v1/write"},
        {"url": "https://mimir.example/api/v1/push"},
    ]
    committed = yaml.safe_load((REPO / "layerwatch" / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert "remote_write" not in committed  # config.REMOTE_WRITE_URLS is empty


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("victoriametrics:8428/api/v1/write", "not an http(s) URL"),
        ("ftp://store/write", "not an http(s) URL"),
        ("http:///api/v1/write", "not an http(s) URL"),
        ("http://vm:99999/api/v1/write", "port outside"),
        ("http://vm:0/api/v1/write", "port outside"),
        ("http://vm:8428/api/v1/write two", "space or control character"),
        ("http://vm:8428/api/v1/write\n", "space or control character"),
        ("http://admin@vm:8428/api/v1/write", "carries credentials"),
    ],
)
def test_remote_write_refuses_urls_prometheus_would_refuse_or_should_not_hold(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(url)) + ".*" + re.escape(problem)):
        deploy.prometheus_config(
            shim_targets=[], exporter_targets=[], alertmanager_targets=[], rule_files=[], remote_write_urls=[url]
        )


@pytest.mark.parametrize(
    ("urls", "problem"),
    [
        (["http://vm:8428/api/v1/write", "http://vm:8428/api/v1/write"], "listed twice"),
        ("http://vm:8428/api/v1/write", "must be a list"),
    ],
)
def test_remote_write_refuses_duplicates_and_a_bare_string(urls, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        deploy.prometheus_config(
            shim_targets=[], exporter_targets=[], alertmanager_targets=[], rule_files=[], remote_write_urls=urls
        )


def test_rules_glob_never_matches_the_promtool_tests() -> None:
    rules_dir = REPO / "layerwatch" / "alerts" / "generated"
    assert [p.name for p in rules_dir.glob(deploy.RULES_GLOB)] == [deploy.RULES_FILE]
    assert not list((REPO / "layerwatch" / "alerts" / "tests").glob(deploy.RULES_GLOB))


@pytest.mark.parametrize("which", ["rendered", "committed"])
def test_amtool_check_config(amtool: str, stack: deploy.Stack, which: str) -> None:
    path = stack.alertmanager_config if which == "rendered" else COMMITTED_ALERTMANAGER
    result = run_tool(amtool, "check-config", path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "labels, receiver",
    [
        (["severity=critical", "alertname=LayerwatchEntropyShapeChanged", "model_name=demo"], "pager"),
        (["severity=critical", "alertname=LayerwatchTargetDown", "instance=shim:8000"], "pager"),
        (["severity=warning", "alertname=LayerwatchSkipRateSurge", "model_name=demo"], "ticket"),
        (["alertname=SomethingWithoutSeverity"], "ticket"),
    ],
)
def test_routes_by_severity(amtool: str, labels: list[str], receiver: str) -> None:
    result = run_tool(
        amtool,
        "config",
        "routes",
        "test",
        f"--config.file={COMMITTED_ALERTMANAGER}",
        f"--verify.receivers={receiver}",
        *labels,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wrong = "ticket" if receiver == "pager" else "pager"
    result = run_tool(
        amtool,
        "config",
        "routes",
        "test",
        f"--config.file={COMMITTED_ALERTMANAGER}",
        f"--verify.receivers={wrong}",
        *labels,
    )
    assert result.returncode != 0


# --- a real Alertmanager: inhibition and notifications --------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Webhooks:
    """Collects the alerts Alertmanager posts, by receiver path (/pager, /ticket)."""

    def __init__(self) -> None:
        received: dict[str, list[dict]] = {"/pager": [], "/ticket": []}
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received[self.path].extend(body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def names(self, path: str) -> set[tuple[str, str, str]]:
        return {
            (a["labels"]["alertname"], a["labels"].get("instance", ""), a["labels"]["severity"])
            for a in self.received[path]
        }


def alert(name: str, severity: str, **labels: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, **labels}, "annotations": {"summary": name}}


@pytest.mark.parametrize(
    "labels, receivers",
    [
        (["severity=critical", "alertname=LayerwatchRoutingStatic", "model_name=demo"], "mitigation,pager"),
        (["severity=warning", "alertname=LayerwatchEntropyDrift", "model_name=demo"], "mitigation,ticket"),
        (["severity=critical", "alertname=SomethingElse"], "pager"),
    ],
)
def test_the_optional_mitigation_route_gets_every_layerwatch_alert_and_the_rest_routes_as_before(
    amtool: str, tmp_path: Path, labels: list[str], receivers: str
) -> None:
    assert "mitigation" not in COMMITTED_ALERTMANAGER.read_text()  # off by default
    rendered = deploy.alertmanager_config(
        pager_url=config.PAGER_URL,
        ticket_url=config.TICKET_URL,
        mitigation=deploy.MitigationWebhook("http://shim:8001/alerts", "/etc/alertmanager/secrets/mitigation.token"),
    )
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(rendered))
    assert run_tool(amtool, "check-config", path).returncode == 0
    result = run_tool(
        amtool, "config", "routes", "test", f"--config.file={path}", f"--verify.receivers={receivers}", *labels
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (receiver,) = [r for r in rendered["receivers"] if r["name"] == "mitigation"]
    authorization = receiver["webhook_configs"][0]["http_config"]["authorization"]
    assert authorization == {"type": "Bearer", "credentials_file": "/etc/alertmanager/secrets/mitigation.token"}


def test_alertmanager_inhibits_and_notifies(alertmanager_binary: str, tmp_path: Path, reference_profiles) -> None:
    hooks = Webhooks()
    stack = deploy.render_stack(
        tmp_path,
        profiles=reference_profiles,
        shim_targets=["x:1"],
        exporter_targets=["x:2"],
        alertmanager_target="x:3",
        pager_url=f"{hooks.url}/pager",
        ticket_url=f"{hooks.url}/ticket",
        time_scale=0.01,
    )  # group_wait 30s -> 300ms
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/v2"
    process = subprocess.Popen(
        [
            alertmanager_binary,
            f"--config.file={stack.alertmanager_config}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert wait_for(lambda: _ready(api)), "alertmanager did not start"
        alerts = [
            # shim-a is down: its other alerts are inhibited.
            alert("LayerwatchTargetDown", "critical", job="layerwatch-shim", instance="shim-a"),
            alert("LayerwatchRunawaySkipping", "critical", model_name="demo", instance="shim-a"),
            # exporter-b: the critical zero-ratio alert inhibits the warning of the same alert.
            alert("LayerwatchZeroEntropyRatioHigh", "critical", model_name="demo", instance="exporter-b"),
            alert("LayerwatchZeroEntropyRatioHigh", "warning", model_name="demo", instance="exporter-b"),
            # shim-c: a lone warning goes to the ticket receiver.
            alert("LayerwatchSkipRateSurge", "warning", model_name="demo", instance="shim-c"),
        ]
        request = urllib.request.Request(
            f"{api}/alerts", json.dumps(alerts).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        urllib.request.urlopen(request, timeout=5).close()

        states = wait_for(lambda: _states(api) if len(_states(api)) == len(alerts) else None)
        assert states == {
            ("LayerwatchTargetDown", "shim-a", "critical"): False,
            ("LayerwatchRunawaySkipping", "shim-a", "critical"): True,
            ("LayerwatchZeroEntropyRatioHigh", "exporter-b", "critical"): False,
            ("LayerwatchZeroEntropyRatioHigh", "exporter-b", "warning"): True,
            ("LayerwatchSkipRateSurge", "shim-c", "warning"): False,
        }  # (alertname, instance, severity) -> inhibited

        expected_pager = {
            ("LayerwatchTargetDown", "shim-a", "critical"),
            ("LayerwatchZeroEntropyRatioHigh", "exporter-b", "critical"),
        }
        expected_ticket = {("LayerwatchSkipRateSurge", "shim-c", "warning")}
        assert wait_for(
            lambda: hooks.names("/pager") == expected_pager and hooks.names("/ticket") == expected_ticket
        ), hooks.received
    finally:
        process.terminate()
        process.wait(timeout=10)
        hooks.server.shutdown()


def _ready(api: str) -> bool:
    try:
        urllib.request.urlopen(f"{api}/status", timeout=1).close()
        return True
    except OSError:
        return False


def _states(api: str) -> dict[tuple[str, str, str], bool]:
    with urllib.request.urlopen(f"{api}/alerts", timeout=5) as response:
        alerts = json.load(response)
    return {
        (a["labels"]["alertname"], a["labels"].get("instance", ""), a["labels"]["severity"]): bool(
            a["status"]["inhibitedBy"]
        )
        for a in alerts
    }


# --- Grafana provisioning and docker-compose ---------------------------------------------------------


def test_grafana_datasource_interval_equals_the_scrape_interval() -> None:
    prometheus = yaml.safe_load((REPO / "layerwatch/deploy/prometheus/prometheus.yml").read_text())
    datasources = yaml.safe_load(
        (REPO / "layerwatch/deploy/grafana/provisioning/datasources/layerwatch.yaml").read_text()
    )["datasources"]
    assert datasources[0]["uid"] == config.GRAFANA_DATASOURCE_UID
    assert datasources[0]["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]


def compose_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    return {**env, **extra}


def test_docker_compose_config_is_valid(docker_compose: str) -> None:
    env = compose_env(GRAFANA_ADMIN_PASSWORD="only-for-this-test")
    result = run_tool(docker_compose, "-f", COMPOSE_FILES[0], "config", "-q", env=env)
    assert result.returncode == 0, result.stderr
    result = run_tool(docker_compose, *[a for f in COMPOSE_FILES for a in ("-f", f)], "config", "-q", env=env)
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_with_vllm_is_valid(docker_compose: str) -> None:
    env = compose_env(GRAFANA_ADMIN_PASSWORD="only-for-this-test")
    resolved = {}
    for name, files in (("cpu", COMPOSE_FILES[:1]), ("gpu", COMPOSE_FILES)):
        argv = [a for f in files for a in ("-f", f)]
        result = run_tool(docker_compose, *argv, "--profile", "vllm", "config", env=env)
        assert result.returncode == 0, result.stderr
        resolved[name] = yaml.safe_load(result.stdout)["services"]["vllm"]
    assert "args" not in resolved["cpu"]["build"]  # the Dockerfile's default: vLLM's CPU image
    assert resolved["gpu"]["build"]["args"]["VLLM_IMAGE"].startswith("vllm/vllm-openai:")
    assert resolved["gpu"]["deploy"]["resources"]["reservations"]["devices"]


def test_compose_vllm_runs_the_plugin_with_the_deploy_arguments() -> None:
    """docker-compose.yml spells out `vllm serve`'s arguments; they must be layerwatch/deploy/vllm.py's, which
    the Kubernetes variant uses, with the compose exporter's frame address and the served model's profile."""
    service = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["vllm"]
    frames = f"exporter:{ports.EXPORTER_FRAMES_PORT}"
    assert service["command"] == vllm.serve_args(frames)
    assert service["profiles"] == ["vllm"]  # `docker compose up` alone still runs the shim only
    assert (REPO / "layerwatch/alerts/profiles" / f"{config.VLLM_SERVED_MODEL_NAME}.yaml").is_file()
    dockerfile = (REPO / service["build"]["dockerfile"]).read_text()
    assert re.findall(r"^USER (\S+)", dockerfile, re.M)[-1] not in ("root", "0")
    assert re.search(r"^ARG VLLM_IMAGE=\S*cpu\S*:v", dockerfile, re.M)  # the CPU image unless told otherwise
    assert '".[vllm]"' in dockerfile and 'ENTRYPOINT ["vllm", "serve"]' in dockerfile


def test_compose_vllm_guard_fronts_the_compose_vllm_under_its_profile() -> None:
    """The quality guard of the vLLM profile: vLLM's compose address upstream, the served model's name, the port
    the committed prometheus.yml scrapes, and vLLM serving priorities for its re-checks."""
    from layerwatch.cli.main import build_parser

    services = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]
    guard = services[config.COMPOSE_VLLM_GUARD_SERVICE]
    assert guard["profiles"] == ["vllm"] and guard["image"] == services["exporter"]["image"]
    command = guard["command"][1:]  # after `layerwatch`
    argv = build_parser(command, environ={}).parse_args(command)
    assert argv.upstream == f"http://{config.COMPOSE_VLLM_SERVICE}:{ports.VLLM_HTTP_PORT}"
    assert argv.listen == ("0.0.0.0", ports.VLLM_GUARD_PORT)
    assert argv.served_model_name == config.VLLM_SERVED_MODEL_NAME
    assert "--scheduling-policy" in vllm.serve_args("exporter:9410")


def test_docker_compose_requires_the_grafana_password(docker_compose: str) -> None:
    result = run_tool(docker_compose, "-f", COMPOSE_FILES[0], "config", "-q", env=compose_env())
    assert result.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in result.stderr


def test_the_documented_override_for_a_model_without_gates_passes_serves_checks() -> None:
    """docs/deploy.md's override for a model without gates, on top of compose's own environment: the
    settings `serve --no-gates` refuses are all at their defaults (compose's LAYERWATCH_SHADOW_RATE
    0.05 made the documented `LAYERWATCH_NO_GATES: "true"` exit 2 naming --shadow-rate)."""
    from layerwatch.cli.main import build_parser
    from layerwatch.cli.serve import settings_from_arguments
    from layerwatch.inference_shim.service.settings import GATED_SETTINGS
    from layerwatch.settings import changed_from_default

    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs/deploy.md").read_text(), re.DOTALL)
    (override,) = [yaml.safe_load(b) for b in blocks if "LAYERWATCH_NO_GATES" in b]
    compose = yaml.safe_load(COMPOSE_FILES[0].read_text())
    environ = compose["services"]["shim"]["environment"] | override["services"]["shim"]["environment"]
    args = build_parser(["serve"], environ).parse_args(["serve"])
    settings = settings_from_arguments(args)
    assert settings.no_gates and changed_from_default(settings, GATED_SETTINGS) == []


def test_compose_publishes_on_loopback_and_mounts_the_generated_files() -> None:
    compose = yaml.safe_load(COMPOSE_FILES[0].read_text())
    services = compose["services"]
    assert set(services) == {"shim", "vllm", "vllm-guard", "exporter", "prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    assert "--host" in services["shim"]["command"] and "0.0.0.0" in services["shim"]["command"]
    mounts = {v.split(":")[0]: v.split(":")[1] for s in services.values() for v in s.get("volumes", [])}
    assert mounts["./layerwatch/alerts/generated"] == "/etc/prometheus/rules"
    assert mounts["./layerwatch/dashboards/json"] == config.GRAFANA_DASHBOARD_DIR
    prometheus = yaml.safe_load((REPO / "layerwatch/deploy/prometheus/prometheus.yml").read_text())
    assert prometheus["rule_files"] == [f"/etc/prometheus/rules/{deploy.RULES_GLOB}"]
    for path in mounts:
        if path.startswith("./"):
            assert (REPO / path).exists(), path


def test_dockerfiles_run_as_non_root_and_pin_torch_like_pyproject() -> None:
    serve = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    (torch_pin,) = [d for d in serve if d.startswith("torch")]
    for name in ("shim.Dockerfile", "exporter.Dockerfile"):
        text = (REPO / "layerwatch" / "deploy" / name).read_text()
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0"), name
    shim = (REPO / "layerwatch" / "deploy" / "shim.Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in shim
    assert "[serve]" not in (REPO / "layerwatch" / "deploy" / "exporter.Dockerfile").read_text()


# Runs a command with only `folders` importable from the project: the editable install's finder,
# which would find any package of the checkout, is taken off sys.meta_path first.
_IMAGE_PYTHON = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
from layerwatch.cli.main import main
sys.argv = ["layerwatch", *sys.argv[2:]]
try:
    main()
except SystemExit as exc:
    sys.exit(exc.code)
"""


@pytest.mark.parametrize(
    ("dockerfile", "command"),
    [("exporter.Dockerfile", "exporter"), ("exporter.Dockerfile", "vllm-guard"), ("shim.Dockerfile", "serve")],
)
def test_each_image_copies_every_package_its_command_imports(tmp_path: Path, dockerfile: str, command: str) -> None:
    """The image's COPY lines are the whole project inside it: its command must start (--help
    imports the command and its libraries) from those folders alone."""
    copies = re.findall(r"^COPY ((?:\S+ )+)\./(\S+)$", (REPO / "layerwatch" / "deploy" / dockerfile).read_text(), re.M)
    assert copies, dockerfile
    for sources, destination in copies:
        for path in (found for pattern in sources.split() for found in REPO.glob(pattern)):
            target = tmp_path / destination / path.name if destination.endswith("/") else tmp_path / destination
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    image_env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}  # only what is copied
    result = subprocess.run(
        [sys.executable, "-c", _IMAGE_PYTHON, str(tmp_path), command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=image_env,
    )
    assert result.returncode == 0, result.stderr
    missing = subprocess.run(
        [sys.executable, "-c", _IMAGE_PYTHON, str(tmp_path), "generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=image_env,
    )
    assert missing.returncode == 2 and "not available in this installation" in missing.stderr


def test_rendered_stack_pages_on_a_down_target(tmp_path: Path, reference_profiles, alertmanager_binary: str) -> None:
    """Real Prometheus + Alertmanager from render_stack: the shim target answers nothing, so
    LayerwatchTargetDown fires (for: 2m scaled to 1.2s) and reaches the pager webhook."""
    prometheus_binary = require_binary("prometheus")
    hooks = Webhooks()
    am_port, prom_port, dead_port = free_port(), free_port(), free_port()
    stack = deploy.render_stack(
        tmp_path,
        profiles=reference_profiles,
        shim_targets=[f"127.0.0.1:{dead_port}"],
        exporter_targets=[f"127.0.0.1:{am_port}"],  # answers /metrics: an "up" target
        alertmanager_target=f"127.0.0.1:{am_port}",
        pager_url=f"{hooks.url}/pager",
        ticket_url=f"{hooks.url}/ticket",
        scrape_interval=0.5,
        evaluation_interval=0.5,
        time_scale=0.01,
    )
    processes = [
        subprocess.Popen(
            [
                alertmanager_binary,
                f"--config.file={stack.alertmanager_config}",
                f"--storage.path={tmp_path / 'am'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                prometheus_binary,
                f"--config.file={stack.prometheus_config}",
                f"--storage.tsdb.path={tmp_path / 'prom'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        paged = wait_for(lambda: hooks.names("/pager"), timeout=30)
        assert paged == {("LayerwatchTargetDown", f"127.0.0.1:{dead_port}", "critical")}, hooks.received
        page = hooks.received["/pager"][0]
        assert page["labels"]["job"] == config.SHIM_JOB
        assert page["annotations"]["runbook_url"].endswith("#layerwatchtargetdown")
        assert hooks.received["/ticket"] == []
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)
        hooks.server.shutdown()
