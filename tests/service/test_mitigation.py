"""Alert-driven mitigation: the state per alert (idempotent, order-proof, bounded in requests and
time), the webhook receiver on real loopback sockets (auth, bad payloads, size), and a served model
whose requests get shadow-checked or run at full depth while an alert fires."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import re
import signal
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from layerwatch import http_listener, log_limit
from layerwatch.alerts.specs import ALERTS
from layerwatch.demo.processes import LAYERWATCH_COMMAND, ManagedProcess, free_port
from layerwatch.inference_shim.service import mitigation_receiver
from layerwatch.inference_shim.service.depth import parse_rollout_levels
from layerwatch.inference_shim.service.mitigation import (
    ALERT_OUTCOMES,
    ALERTS_PER_LOCK_HOLD,
    MAX_ALERTS_PER_NOTIFICATION,
    MAX_MITIGATION_MINUTES,
    MAX_TRACKED_ALERTS,
    MITIGATING_ALERTS,
    NO_MITIGATION,
    PAGING_SEVERITY,
    MitigationMetrics,
    Mitigations,
    MitigationSettings,
    PagingEvent,
    RequestMitigation,
    parse_notification,
)
from layerwatch.inference_shim.service.mitigation_receiver import (
    MAX_BODY_BYTES,
    WEBHOOK_PATH,
    MitigationReceiver,
    reserve,
)
from layerwatch.mixin import config
from tests.service.conftest import MODEL_NAME
from tests.slow_clients import Trickler
from tests.support import sample_sum, wait_for

TOKEN = b"mitigation-token-0123456789abcdef0123"
T0 = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def alert(
    name: str = "LayerwatchRoutingStatic",
    *,
    status: str = "firing",
    model: str = MODEL_NAME,
    severity: str = "critical",
    fingerprint: str = "a1b2c3d4e5f60718",
    starts_at: datetime = T0,
) -> dict:
    resolved = status == "resolved"
    return {
        "status": status,
        "labels": {"alertname": name, "model_name": model, "severity": severity, "instance": "shim:8000"},
        "annotations": {"summary": "..."},
        "startsAt": starts_at.isoformat().replace("+00:00", "Z"),
        "endsAt": (starts_at + timedelta(minutes=5)).isoformat() if resolved else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fingerprint,
    }


def notification(*alerts: dict) -> bytes:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return json.dumps(
        {
            "version": "4",
            "groupKey": "{}:{}",
            "truncatedAlerts": 0,
            "status": status,
            "receiver": "mitigation",
            "groupLabels": {},
            "commonLabels": {},
            "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093",
            "alerts": list(alerts),
        }
    ).encode()


def mitigations(requests: int = 3, minutes: float = 10.0, full_depth: bool = False, shadow_rate: float = 0.0):
    registry = CollectorRegistry()
    clock = FakeClock()
    state = Mitigations(
        MODEL_NAME,
        MitigationSettings(requests, minutes * 60, full_depth, shadow_rate),
        MitigationMetrics(registry, MODEL_NAME),
        clock=clock,
    )
    return state, registry, clock


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_name": MODEL_NAME, **labels}) or 0.0


def apply(state: Mitigations, *alerts: dict) -> list[str]:
    return state.apply(parse_notification(notification(*alerts)))


# --- the state ---------------------------------------------------------------------------------------


def test_the_mitigating_alerts_and_the_paging_severity_are_the_generated_ones():
    assert set(MITIGATING_ALERTS) <= {spec.name for spec in ALERTS}
    assert PAGING_SEVERITY == config.SEVERITY_PAGE


def test_a_firing_alert_shadow_checks_the_next_n_requests_then_ends(caplog):
    state, registry, _ = mitigations(requests=3, shadow_rate=0.25)
    assert state.for_new_request() == NO_MITIGATION
    assert value(registry, "layerwatch_mitigation_shadow_rate") == 0.25
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service.mitigation"):
        assert apply(state, alert()) == ["started"]
        assert value(registry, "layerwatch_mitigations_active") == 1
        assert value(registry, "layerwatch_mitigation_shadow_rate") == 1
        assert value(registry, "layerwatch_mitigations_started_total", alertname="LayerwatchRoutingStatic") == 1
        got = [state.for_new_request() for _ in range(4)]
    assert got == [RequestMitigation(None, 1.0)] * 3 + [NO_MITIGATION]
    assert value(registry, "layerwatch_mitigated_requests_total") == 3
    assert value(registry, "layerwatch_mitigations_ended_total", reason="requests") == 1
    assert value(registry, "layerwatch_mitigations_active") == 0
    assert value(registry, "layerwatch_mitigation_shadow_rate") == 0.25
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(
        f"MITIGATION_START alertname=LayerwatchRoutingStatic fingerprint=a1b2c3d4e5f60718 model={MODEL_NAME} "
        'action="shadow_rate=1" requests=3 until='
    )
    assert lines[1] == (
        f"MITIGATION_END alertname=LayerwatchRoutingStatic fingerprint=a1b2c3d4e5f60718 model={MODEL_NAME} "
        "reason=requests requests_left=0"
    )
    # A repeat of the same incident (Alertmanager's repeat_interval) does not start it again.
    assert apply(state, alert()) == ["unchanged"]
    assert state.for_new_request() == NO_MITIGATION


def test_a_mitigation_ends_when_its_time_is_up_or_its_alert_resolves():
    state, registry, clock = mitigations(minutes=2, requests=100)
    apply(state, alert("LayerwatchEntropyDrift", severity="warning"))
    clock.now += 119
    state.expire()
    assert value(registry, "layerwatch_mitigations_active") == 1
    clock.now += 1
    state.expire()
    assert value(registry, "layerwatch_mitigations_active") == 0
    assert value(registry, "layerwatch_mitigations_ended_total", reason="time") == 1
    assert state.for_new_request() == NO_MITIGATION

    apply(state, alert("LayerwatchRunawaySkipping"))
    assert apply(state, alert("LayerwatchRunawaySkipping", status="resolved")) == ["ended"]
    assert value(registry, "layerwatch_mitigations_ended_total", reason="resolved") == 1
    assert state.for_new_request() == NO_MITIGATION


def test_full_depth_runs_mitigated_requests_at_threshold_zero_without_shadow_checks():
    state, registry, _ = mitigations(full_depth=True, shadow_rate=0.5)
    assert value(registry, "layerwatch_mitigation_full_depth") == 0
    apply(state, alert())
    assert state.for_new_request() == RequestMitigation(threshold=0.0, shadow_rate=0.0)
    assert value(registry, "layerwatch_mitigation_full_depth") == 1
    assert value(registry, "layerwatch_mitigation_shadow_rate") == 0
    apply(state, alert(status="resolved"))
    assert value(registry, "layerwatch_mitigation_full_depth") == 0
    assert value(registry, "layerwatch_mitigation_shadow_rate") == 0.5


def test_each_alert_has_its_own_budget_and_requests_count_against_all():
    state, registry, _ = mitigations(requests=2)
    apply(state, alert(fingerprint="1"))
    state.for_new_request()
    assert apply(state, alert("LayerwatchEntropyDrift", fingerprint="2"), alert(fingerprint="1")) == [
        "started",
        "unchanged",
    ]
    assert value(registry, "layerwatch_mitigations_active") == 2
    state.for_new_request()  # the first alert's second request, the drift's first
    assert value(registry, "layerwatch_mitigations_active") == 1
    assert state.for_new_request() != NO_MITIGATION
    assert state.for_new_request() == NO_MITIGATION


@pytest.mark.parametrize(
    "order",
    [("firing", "resolved"), ("resolved", "firing"), ("firing", "resolved", "firing", "resolved")],
    ids=["in-order", "resolved-first", "repeated"],
)
def test_any_order_of_one_incidents_deliveries_ends_with_no_mitigation(order):
    state, registry, _ = mitigations()
    for status in order:
        apply(state, alert(status=status))
    assert state.for_new_request() == NO_MITIGATION
    assert value(registry, "layerwatch_mitigations_active") == 0
    assert value(registry, "layerwatch_mitigations_started_total", alertname="LayerwatchRoutingStatic") == (
        0 if order[0] == "resolved" else 1
    )


def test_a_late_notification_of_an_earlier_incident_is_stale():
    state, registry, _ = mitigations()
    later = T0 + timedelta(hours=1)
    apply(state, alert(starts_at=later))
    assert apply(state, alert(status="resolved", starts_at=T0)) == ["stale"]
    assert value(registry, "layerwatch_mitigations_active") == 1
    assert apply(state, alert(status="resolved", starts_at=later)) == ["ended"]
    # The same alert firing again later is a new incident: a new mitigation.
    assert apply(state, alert(starts_at=later + timedelta(hours=1))) == ["started"]
    assert value(registry, "layerwatch_mitigation_alerts_total", outcome="stale") == 1


def test_alerts_of_other_models_and_other_alerts_are_ignored_and_counted():
    state, registry, _ = mitigations()
    outcomes = apply(
        state,
        alert(model="another-model"),
        alert("LayerwatchSkipRateSurge", severity="warning"),
        alert("LayerwatchEntropyShapeChanged", severity="critical"),
    )
    assert outcomes == ["other_model", "not_mitigating", "not_mitigating"]
    assert state.for_new_request() == NO_MITIGATION
    assert value(registry, "layerwatch_mitigation_alerts_total", outcome="other_model") == 1
    assert value(registry, "layerwatch_mitigation_alerts_total", outcome="not_mitigating") == 2


def test_the_alerts_known_stay_bounded_when_all_of_them_mitigate():
    # Only inactive alerts were evicted: 1005 firing fingerprints were 1005 budgets, each one
    # walked by every request under the lock.
    state, registry, clock = mitigations(requests=100)
    apply(state, *(alert(fingerprint=f"old-{i}") for i in range(5)))
    clock.now += 1
    apply(state, *(alert(fingerprint=f"new-{i}") for i in range(MAX_TRACKED_ALERTS)))
    in_effect = {m["fingerprint"] for m in state.in_effect()}
    assert in_effect == {f"new-{i}" for i in range(MAX_TRACKED_ALERTS)}
    assert value(registry, "layerwatch_mitigations_ended_total", reason="evicted") == 5
    assert value(registry, "layerwatch_mitigations_active") == MAX_TRACKED_ALERTS


def test_a_large_notification_is_applied_a_few_alerts_per_lock_hold():
    """Every new request takes the lock at admission, on the API's event loop: a body of 1000
    alerts starting mitigations held it about 50 ms in one piece (docs/service.md)."""
    state, registry, _ = mitigations(requests=100)
    per_hold: list[int] = []

    def applied() -> float:
        return sum(value(registry, "layerwatch_mitigation_alerts_total", outcome=o) for o in ALERT_OUTCOMES)

    class CountingLock:  # how many alerts each hold of the state's lock applied
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            self._lock.acquire()
            self._before = applied()

        def __exit__(self, *exc: object) -> None:
            per_hold.append(int(applied() - self._before))
            self._lock.release()

    state._lock = CountingLock()  # type: ignore[assignment]
    outcomes = apply(state, *(alert(fingerprint=f"{i:016x}") for i in range(MAX_ALERTS_PER_NOTIFICATION)))
    assert outcomes == ["started"] * MAX_ALERTS_PER_NOTIFICATION
    assert value(registry, "layerwatch_mitigations_active") == MAX_ALERTS_PER_NOTIFICATION
    assert sum(per_hold) == MAX_ALERTS_PER_NOTIFICATION and max(per_hold) == ALERTS_PER_LOCK_HOLD


def test_paging_callbacks_hear_each_paging_alert_fire_and_resolve_once():
    state, _, _ = mitigations()
    events: list[PagingEvent] = []
    state.on_paging.append(events.append)
    state.on_paging.insert(0, lambda event: 1 / 0)  # a failing reaction does not stop the others
    apply(state, alert("LayerwatchEntropyShapeChanged"), alert("LayerwatchEntropyDrift", severity="warning"))
    apply(state, alert("LayerwatchEntropyShapeChanged"))  # a repeat
    apply(state, alert("LayerwatchEntropyShapeChanged", status="resolved"))
    apply(state, alert("LayerwatchEntropyShapeChanged", model="another-model"))
    assert [(e.alertname, e.firing) for e in events] == [
        ("LayerwatchEntropyShapeChanged", True),
        ("LayerwatchEntropyShapeChanged", False),
    ]


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="--mitigation-requests must be >= 1"):
        MitigationSettings(0, 60, False, 0.0)
    for minutes in (float("nan"), float("inf"), 5e9, MAX_MITIGATION_MINUTES + 1):
        with pytest.raises(ValueError, match="--mitigation-minutes must be a positive number of at most 525600"):
            MitigationSettings(1, minutes * 60, False, 0.0)


def test_the_longest_mitigation_starts():
    # Were 5e9 minutes accepted, the first mitigating alert would raise
    # OverflowError (a datetime past year 9999): no answer, no mitigation.
    state, registry, _ = mitigations(minutes=MAX_MITIGATION_MINUTES)
    assert apply(state, alert()) == ["started"]
    assert value(registry, "layerwatch_mitigations_active") == 1


# --- the receiver on a real socket -------------------------------------------------------------------


@pytest.fixture
def receiver():
    state, registry, _ = mitigations()
    server = MitigationReceiver(reserve(("127.0.0.1", 0)), state, lambda: TOKEN)
    server.start()
    host, port = server.address
    yield f"http://{host}:{port}", state, registry
    server.stop()


def post(url: str, body: bytes, authorization: str | None = f"Bearer {TOKEN.decode()}", path: str = WEBHOOK_PATH):
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=10)


def test_the_receiver_acts_on_an_authenticated_notification(receiver):
    url, state, registry = receiver
    response = post(url, notification(alert()))
    assert response.status_code == 200 and response.json() == {"outcomes": ["started"]}
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="accepted") == 1
    assert state.for_new_request().shadow_rate == 1.0


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token-0123456789abcdef0123456", f"Bearer {TOKEN.decode()}x", f"Basic {TOKEN.decode()}"],
    ids=["none", "wrong", "longer", "basic"],
)
def test_no_or_a_wrong_token_gets_401_and_changes_nothing(receiver, authorization):
    url, state, registry = receiver
    response = post(url, notification(alert()), authorization)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="unauthorized") == 1
    assert state.for_new_request() == NO_MITIGATION
    # Not even which paths exist: a GET without the token gets 401 too.
    assert httpx.get(f"{url}/", timeout=10).status_code == 401


@pytest.mark.parametrize(
    "body, problem",
    [
        (b"{not json", "Invalid JSON"),
        (json.dumps({"version": "3", "status": "firing", "alerts": []}).encode(), "version"),
        (notification({**alert(), "status": "pending"}), "alerts.0.status"),
        (notification({**alert(), "labels": {"model_name": MODEL_NAME}}), "an alert needs the label alertname"),
        (notification({**alert(), "startsAt": "yesterday"}), "alerts.0.startsAt"),
        (notification({k: v for k, v in alert().items() if k != "fingerprint"}), "alerts.0.fingerprint"),
        (json.dumps([1, 2]).encode(), "body"),
    ],
    ids=["not-json", "version-3", "bad-status", "no-alertname", "bad-time", "no-fingerprint", "not-an-object"],
)
def test_a_malformed_notification_gets_400_naming_the_problem(receiver, body, problem):
    url, state, registry = receiver
    response = post(url, body)
    assert response.status_code == 400, response.text
    assert problem in response.json()["error"] and "Alertmanager version-4 webhook payload" in response.json()["error"]
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="malformed") == 1
    assert state.for_new_request() == NO_MITIGATION


def test_a_time_without_a_zone_gets_400_and_leaves_the_known_incident_as_it_was(receiver):
    # Ordering a naive startsAt against the known (zoned) one raised TypeError: the connection was
    # dropped without a reply or a count, part of the notification applied.
    url, state, registry = receiver
    assert post(url, notification(alert())).json() == {"outcomes": ["started"]}
    naive = {**alert(status="resolved"), "startsAt": T0.replace(tzinfo=None).isoformat()}
    response = post(url, notification(naive))
    assert response.status_code == 400 and "alerts.0.startsAt" in response.json()["error"]
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="malformed") == 1
    assert [m["starts_at"] for m in state.in_effect()] == [T0.isoformat()]


def test_a_body_over_the_limit_is_refused_unread_and_other_paths_are_not_found(receiver):
    url, _, registry = receiver
    huge = notification(alert()) + b" " * MAX_BODY_BYTES
    assert post(url, huge).status_code == 413
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="too_large") == 1
    assert post(url, notification(alert()), path="/other").status_code == 404
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="not_found") == 1


@pytest.fixture(autouse=True)
def full_log_allowance(monkeypatch):
    """Each test starts with the refusal log lines' whole allowance (log_limit.RateLimit keeps it
    per process): a test that reads a refusal's log line must not find it spent by earlier tests."""
    for logger in (mitigation_receiver.log, http_listener.log):
        monkeypatch.setattr(logger, "filters", [log_limit.RateLimit()])


@contextlib.contextmanager
def running_receiver(**limits):
    """A receiver on a loopback port with LIMITS changed by `limits`: (address, state, registry)."""
    state, registry, _ = mitigations()
    server = MitigationReceiver(
        reserve(("127.0.0.1", 0)), state, lambda: TOKEN, dataclasses.replace(mitigation_receiver.LIMITS, **limits)
    )
    server.start()
    try:
        yield server.address, state, registry
    finally:
        server.stop()


def authenticated_head(length: int, path: str = WEBHOOK_PATH) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN.decode()}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def whole_answer(client: socket.socket, timeout: float = 10.0) -> bytes:
    client.settimeout(timeout)
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := client.recv(4096):
            answer += chunk
    return answer


def test_a_stalled_body_is_cut_off_with_408():
    with running_receiver(body_timeout=0.5) as (address, _, registry):
        with socket.create_connection(address, timeout=10) as client:
            client.sendall(authenticated_head(100) + b'{"version"')
            assert whole_answer(client).startswith(b"HTTP/1.1 408")
        assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="malformed") == 1


def test_a_body_trickled_byte_by_byte_is_cut_off_with_408_on_time():
    # Each byte comes well within any per-read timeout; the body as a whole does not.
    body = notification(alert())
    with running_receiver(body_timeout=1.0) as (address, state, registry):
        with socket.create_connection(address, timeout=10) as client:
            client.sendall(authenticated_head(len(body)))
            client.settimeout(0.3)
            reply = b""
            for byte in body[:12]:  # 12 x 0.3 s: over three times the limit
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    client.sendall(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    reply = client.recv(4096)
                if reply:
                    break
            assert reply.startswith(b"HTTP/1.1 408"), reply
        assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="malformed") == 1
        assert state.for_new_request() == NO_MITIGATION


def test_stopping_with_connections_open_logs_no_traceback(caplog):
    """CI, stop 29: an exporter stopped while a probe's connection lingered after its answer logged
    asyncio's "Exception in callback" with a CancelledError traceback. Every stage a connection can
    be in when the listener stops: lingering after its answer, waiting for its head, for its body."""
    caplog.set_level(logging.ERROR)
    with running_receiver() as (address, _, _):
        lingering, waiting, stalled = (socket.create_connection(address, timeout=10) for _ in range(3))
        lingering.sendall(authenticated_head(2) + b"{}")
        lingering.recv(1)  # its answer is written: the listener drains what else it sends
        waiting.sendall(b"POST / HTTP/1.1\r\n")
        stalled.sendall(authenticated_head(100) + b"{")
        time.sleep(0.2)
    for client in (lingering, waiting, stalled):
        client.close()
    assert not caplog.records, caplog.text


class _LoopStaller(http_listener.Handler):
    """Holds the listener's event loop in `screen` (which runs on it) for the first request, as a
    loaded machine may: whatever arrives meanwhile is handled in the loop's turn after it."""

    def __init__(self) -> None:
        self.stalled, self.release = threading.Event(), threading.Event()

    def screen(self, head):
        if not self.stalled.is_set():
            self.stalled.set()
            self.release.wait(10)
        return None


def test_a_stop_in_the_same_loop_turn_as_new_input_ends_every_connection_at_once(caplog):
    """A stop that lands in the loop's turn with connections just accepted, and with a head just
    completed, must end them all at once: before, the accepted ones were left as pending tasks,
    their sockets open ("Task was destroyed but it is pending!" or Python 3.11's Server._attach
    assertion, silently), and the head's reader swallowed its cancellation (asyncio.wait_for) so
    that stop() waited for its body's whole timeout."""
    caplog.set_level(logging.ERROR)
    handler = _LoopStaller()
    limits = dataclasses.replace(mitigation_receiver.LIMITS, body_timeout=20.0)
    listener = http_listener.Listener(reserve(("127.0.0.1", 0)), handler, limits, "stall-test")
    listener.start()
    address = listener.address
    half_head = socket.create_connection(address, timeout=10)
    half_head.sendall(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n")
    time.sleep(0.2)  # its head is being read (detection only: a later read is the accepted case)
    staller = socket.create_connection(address, timeout=10)
    staller.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert handler.stalled.wait(10)
    arrived = [socket.create_connection(address, timeout=10) for _ in range(8)]  # accepted by the kernel
    half_head.sendall(b"\r\n")
    stopper = threading.Thread(target=listener.stop)
    started = time.monotonic()
    stopper.start()
    stopper.join(0.3)  # stop() has asked the loop to stop: it comes in the turn after the stall
    handler.release.set()
    stopper.join(30)
    took = time.monotonic() - started
    clients = [half_head, staller, *arrived]
    for client in clients:
        client.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while client.recv(4096):
                pass  # the socket is closed, not left open: recv ends, it does not time out
        client.close()
    assert took < 5, f"stop() took {took:.1f} s"
    gc.collect()  # a task left pending is logged when it is collected
    assert not caplog.records, caplog.text


def test_a_taken_port_fails_naming_the_receiver_and_its_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            OSError, match=f"mitigation receiver cannot listen on 127.0.0.1:{port} \\(--mitigation-address\\)"
        ):
            reserve(("127.0.0.1", port))


def test_a_head_trickled_without_a_token_is_cut_off_with_408_and_counted_unauthorized():
    # Headers sent a byte at a time, without any token, held a thread of the shim for ever.
    with running_receiver(head_timeout=1.0) as (address, _, registry):
        started = time.monotonic()
        with Trickler(address, 1, interval=0.1) as trickler:
            while not trickler.answers and time.monotonic() - started < 10:
                time.sleep(0.05)
        waited = time.monotonic() - started
        assert trickler.answers and trickler.answers[0].startswith(b"HTTP/1.1 408"), trickler.answers
        assert 1.0 <= waited < 5.0
        assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="unauthorized") >= 1


def test_trickling_connections_without_the_token_cannot_lock_alertmanager_out():
    """Unguarded, 32 connections trickling a head without a token hold all 32 places of the
    receiver, and Alertmanager's notifications are closed unanswered (17 of 21 over 45 s), the
    attackers not counted. Here each new connection closes the one waiting longest for its head: the
    notifications, whose heads arrive at once, are all served, and every attacker closed is
    counted as unauthorized. Default limits."""
    with running_receiver() as (address, state, registry):
        url = f"http://{address[0]}:{address[1]}"
        with Trickler(address, mitigation_receiver.MAX_CONNECTIONS + 8, interval=0.2) as trickler:
            time.sleep(0.5)  # every place taken, the attackers reconnecting as they are closed
            statuses = []
            for number in range(10):
                response = post(url, notification(alert(fingerprint=f"{number:016x}")))
                statuses.append(response.status_code)
                time.sleep(0.1)
        assert statuses == [200] * 10
        assert len(state.in_effect()) == 10
        closed = value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="unauthorized")
        assert closed >= 18 and trickler.closed_by_server >= 18  # 8 at the start, then one per notification
        assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="accepted") == 10


def test_a_new_connection_gets_503_at_once_when_every_connection_has_its_request_in():
    with running_receiver(max_connections=4, body_timeout=2.0) as (address, _, registry):
        stalled = [socket.create_connection(address, timeout=10) for _ in range(4)]
        try:
            for client in stalled:  # authenticated, their bodies stalled: not to be closed for room
                client.sendall(authenticated_head(100) + b"{")
            time.sleep(0.3)
            with socket.create_connection(address, timeout=10) as extra:
                extra.sendall(authenticated_head(2) + b"{}")
                assert whole_answer(extra, 1.0).startswith(b"HTTP/1.1 503")
            assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="too_many_connections") == 1
            for client in stalled:  # cut off by their own deadline
                assert whole_answer(client).startswith(b"HTTP/1.1 408")
        finally:
            for client in stalled:
                client.close()
        assert post(f"http://{address[0]}:{address[1]}", notification(alert())).status_code == 200


@pytest.mark.parametrize(
    "length",
    [b"\xb2", b"1\xb9", b"+5", b"5, 5", b"0x10"],
    ids=["superscript", "digit-superscript", "sign", "list", "hex"],
)
def test_a_content_length_that_is_not_ascii_digits_gets_400_and_is_counted(length):
    # '²' (byte 0xB2, as the header's Latin-1 reads it) passes str.isdigit()
    # and fails int(): a traceback, a dropped connection, nothing counted.
    with running_receiver() as (address, state, registry):
        head = authenticated_head(0).replace(b"Content-Length: 0", b"Content-Length: " + length)
        with socket.create_connection(address, timeout=10) as client:
            client.sendall(head)
            assert whole_answer(client).startswith(b"HTTP/1.1 400")
        assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="malformed") == 1
        assert state.for_new_request() == NO_MITIGATION


def test_refusals_are_counted_each_and_logged_at_a_bounded_rate(receiver, caplog):
    # A WARNING line per refused request would be 5,000 lines in 12.7 s (835 KiB).
    url, _, registry = receiver
    with caplog.at_level(logging.WARNING):
        for _ in range(100):
            assert post(url, b"{}", authorization=None).status_code == 401
    assert value(registry, "layerwatch_mitigation_webhook_requests_total", outcome="unauthorized") == 100
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= log_limit.BURST + 1, len(refusals)


def test_an_operator_lists_and_ends_the_mitigations_and_repeats_do_not_restart_them(receiver):
    url, state, registry = receiver
    headers = {"Authorization": f"Bearer {TOKEN.decode()}"}
    post(url, notification(alert(), alert("LayerwatchEntropyDrift", severity="warning", fingerprint="2")))
    listed = httpx.get(f"{url}/mitigations", headers=headers, timeout=10).json()["mitigations"]
    assert sorted(m["alertname"] for m in listed) == ["LayerwatchEntropyDrift", "LayerwatchRoutingStatic"]
    assert listed[0]["requests_left"] == 3
    assert httpx.delete(f"{url}/mitigations", timeout=10).status_code == 401
    assert httpx.delete(f"{url}/mitigations", headers=headers, timeout=10).json() == {"ended": 2}
    assert value(registry, "layerwatch_mitigations_ended_total", reason="operator") == 2
    assert post(url, notification(alert())).json() == {"outcomes": ["unchanged"]}  # Alertmanager's repeat
    assert state.for_new_request() == NO_MITIGATION
    assert httpx.get(f"{url}/mitigations", headers=headers, timeout=10).json() == {"mitigations": []}


def test_the_receiver_ends_mitigations_on_time_without_any_traffic():
    registry = CollectorRegistry()
    state = Mitigations(MODEL_NAME, MitigationSettings(100, 0.5, False, 0.0), MitigationMetrics(registry, MODEL_NAME))
    server = MitigationReceiver(reserve(("127.0.0.1", 0)), state, lambda: TOKEN)
    server.start()
    try:
        host, port = server.address
        post(f"http://{host}:{port}", notification(alert()))
        assert value(registry, "layerwatch_mitigations_active") == 1
        deadline = time.monotonic() + 10
        while value(registry, "layerwatch_mitigations_active") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert value(registry, "layerwatch_mitigations_ended_total", reason="time") == 1
    finally:
        server.stop()


# --- the served model --------------------------------------------------------------------------------


def token_file(tmp_path: Path, mode: int = 0o600, content: bytes = TOKEN) -> Path:
    path = tmp_path / "mitigation.token"
    path.write_bytes(content + b"\n")
    path.chmod(mode)
    return path


def greedy(server, max_tokens: int = 6) -> None:
    body = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def metrics_once(server, name: str, at_least: float, **labels: str) -> dict:
    """The server's samples, once `name` counts at least `at_least`."""

    def reached() -> dict | None:
        snapshot = server.metrics()
        return snapshot if sample_sum(snapshot, name, **labels) >= at_least else None

    return wait_for(reached, timeout=30, what=f"{name} >= {at_least}")


def test_a_served_model_shadow_checks_the_requests_of_a_mitigations_budget(in_process, tmp_path):
    port = free_port()
    server = in_process(
        mitigation_address=f"127.0.0.1:{port}", mitigation_token_file=token_file(tmp_path), mitigation_requests=2
    )
    greedy(server)
    assert sample_sum(server.metrics(), "layerwatch_shadow_tokens_total") == 0  # --shadow-rate 0
    assert post(f"http://127.0.0.1:{port}", notification(alert())).json() == {"outcomes": ["started"]}
    for _ in range(3):  # the third is past the budget of 2
        greedy(server)
    snapshot = metrics_once(server, "layerwatch_shadow_tokens_total", 12)
    assert sample_sum(snapshot, "layerwatch_shadow_tokens_total") == 12  # 2 requests x 6 tokens
    assert sample_sum(snapshot, "layerwatch_mitigated_requests_total") == 2
    assert sample_sum(snapshot, "layerwatch_mitigations_ended_total", reason="requests") == 1
    assert sample_sum(snapshot, "layerwatch_mitigations_active") == 0


def test_a_served_model_runs_mitigated_requests_at_full_depth(in_process, tmp_path):
    port = free_port()
    server = in_process(
        mitigation_address=f"127.0.0.1:{port}", mitigation_token_file=token_file(tmp_path), mitigation_full_depth=True
    )
    greedy(server, max_tokens=12)
    skips = sample_sum(server.metrics(), "layerwatch_layer_skips_total")
    assert skips > 0  # the tiny gates skip layers 1-3 after the patience
    post(f"http://127.0.0.1:{port}", notification(alert()))
    assert sample_sum(server.metrics(), "layerwatch_mitigation_full_depth") == 1
    greedy(server, max_tokens=12)
    assert sample_sum(server.metrics(), "layerwatch_layer_skips_total") == skips  # nothing skipped
    post(f"http://127.0.0.1:{port}", notification(alert(status="resolved")))
    greedy(server, max_tokens=12)
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_layer_skips_total") > skips
    assert sample_sum(snapshot, "layerwatch_mitigation_full_depth") == 0
    assert sample_sum(snapshot, "layerwatch_shadow_tokens_total") == 0  # full depth has nothing to check
    depth = {
        (mode, reason): sample_sum(snapshot, "layerwatch_depth_decisions_total", mode=mode, reason=reason)
        for mode, reason in (("full", "override"), ("gated", "default"))
    }
    assert depth == {("full", "override"): 1, ("gated", "default"): 2}


def test_a_forced_full_depth_outranks_the_request_field(in_process, tmp_path):
    port = free_port()
    server = in_process(
        mitigation_address=f"127.0.0.1:{port}",
        mitigation_token_file=token_file(tmp_path),
        mitigation_full_depth=True,
        request_threshold_range=(0.0, 1.0),
    )
    post(f"http://127.0.0.1:{port}", notification(alert()))
    body = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 12, "temperature": 0, "skip_threshold": 0.5}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["layers_skipped"] == 0
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_depth_decisions_total", mode="full", reason="override") == 1
    assert sample_sum(snapshot, "layerwatch_depth_decisions_total", reason="request") == 0


def test_a_paging_alert_demotes_the_staged_rollout_and_its_resolution_does_not_promote(in_process, tmp_path, caplog):
    port = free_port()
    server = in_process(
        mitigation_address=f"127.0.0.1:{port}",
        mitigation_token_file=token_file(tmp_path),
        rollout_levels=parse_rollout_levels("share=0;share=1"),
    )
    greedy(server, max_tokens=12)
    assert sample_sum(server.metrics(), "layerwatch_rollout_level") == 2
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service.depth"):
        post(f"http://127.0.0.1:{port}", notification(alert("LayerwatchRunawaySkipping", severity="warning")))
        assert sample_sum(server.metrics(), "layerwatch_rollout_level") == 2  # a ticket does not demote
        post(f"http://127.0.0.1:{port}", notification(alert(fingerprint="0f0f0f0f0f0f0f0f")))
    snapshot = server.metrics()
    assert sample_sum(snapshot, "layerwatch_rollout_level") == 1
    assert sample_sum(snapshot, "layerwatch_rollout_demotions_total") == 1
    assert any("ROLLOUT_DEMOTED: from_level=2 to_level=1" in r.getMessage() for r in caplog.records)
    skips = sample_sum(snapshot, "layerwatch_layer_skips_total")
    greedy(server, max_tokens=12)  # level 1 enables skipping for no request
    assert sample_sum(server.metrics(), "layerwatch_layer_skips_total") == skips
    post(f"http://127.0.0.1:{port}", notification(alert(status="resolved", fingerprint="0f0f0f0f0f0f0f0f")))
    assert sample_sum(server.metrics(), "layerwatch_rollout_level") == 1


def test_a_rotated_token_file_is_read_again_and_a_broken_replacement_keeps_the_last_token(in_process, tmp_path, caplog):
    # The token was read once at start: after a rotation (Alertmanager reads its credentials_file at
    # each notification) every notification got 401 until the shim restarted.
    port, path = free_port(), token_file(tmp_path)
    in_process(mitigation_address=f"127.0.0.1:{port}", mitigation_token_file=path)
    url, rotated = f"http://127.0.0.1:{port}", b"rotated-token-0123456789abcdef0123456789"
    (tmp_path / "new").mkdir()
    token_file(tmp_path / "new", content=rotated).replace(path)  # written aside, renamed over it
    assert post(url, notification(alert()), f"Bearer {rotated.decode()}").status_code == 200
    assert post(url, notification(alert())).status_code == 401
    path.chmod(0o644)  # broken: the rotated token stays in use, and the log says why
    with caplog.at_level(logging.ERROR, logger="layerwatch.secret_file"):
        assert post(url, notification(alert()), f"Bearer {rotated.decode()}").status_code == 200
    assert "group or others may access it" in caplog.text and "stays in use" in caplog.text
    # A token of bytes no header carries must not be "in use", with every request getting 401.
    token_file(tmp_path / "new", content="é".encode() * 20).replace(path)
    with caplog.at_level(logging.ERROR, logger="layerwatch.secret_file"):
        assert post(url, notification(alert()), f"Bearer {rotated.decode()}").status_code == 200
    assert "byte 0 (0xc3) is not printable ASCII" in caplog.text


@pytest.mark.parametrize(
    "mode, content, problem",
    [
        (0o644, TOKEN, "group or others may access it (mode 0644)"),
        (0o600, b"", "0 bytes, at least 32 needed"),
        (0o600, TOKEN[:20] + b"\t" + TOKEN[20:], "byte 20 (0x09) is not printable ASCII"),
        (0o600, "é".encode() * 20, "byte 0 (0xc3) is not printable ASCII"),
    ],
)
def test_an_unusable_token_file_stops_the_shim_before_the_model_loads(tmp_path, mode, content, problem):
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    path = token_file(tmp_path, mode, content)
    settings = ServeSettings(
        model_dir=tmp_path / "no-model", mitigation_address="127.0.0.1:0", mitigation_token_file=path
    )
    with pytest.raises(
        ValueError, match=f"mitigation token file {path}: .*" + problem.replace("(", r"\(").replace(")", r"\)")
    ):
        ShimService.load(settings)


def test_the_receiver_needs_a_token_file_and_a_listening_address(tmp_path):
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    no_model = tmp_path / "no-model"
    with pytest.raises(ValueError, match="--mitigation-address needs --mitigation-token-file"):
        ShimService.load(ServeSettings(model_dir=no_model, mitigation_address="127.0.0.1:8001"))
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        ShimService.load(ServeSettings(model_dir=no_model, mitigation_address="8001"))
    with pytest.raises(ValueError, match="No such file"):
        ShimService.load(
            ServeSettings(
                model_dir=no_model, mitigation_address="127.0.0.1:0", mitigation_token_file=tmp_path / "absent"
            )
        )


# --- the log lines -----------------------------------------------------------------------------------

LOGFMT_FIELD = r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"=]+)'


def logfmt_fields(line: str, marker: str) -> dict[str, str]:
    """A `MARKER key=value ...` line's fields as a logfmt reader gets them (quoted values are JSON
    strings); fails unless the whole line is the marker and such pairs."""
    assert re.fullmatch(re.escape(marker) + f"(?: {LOGFMT_FIELD})*", line), line
    return {key: json.loads(value) if value.startswith('"') else value for key, value in re.findall(LOGFMT_FIELD, line)}


def test_values_from_a_webhook_cannot_forge_log_fields_or_lines(in_process, tmp_path, caplog):
    """An alert's fingerprint and alertname reach MITIGATION_* and ROLLOUT_* lines: a space, '=' or
    a newline in them must stay inside their own field."""
    forged_fingerprint = "f0 reason=operator\nMITIGATION_END alertname=X"
    forged_name = 'Evil fired" reason=operator\r\nROLLOUT_DEMOTED: from_level=9 to_level=8 \x1b[2K\u2028'
    port = free_port()
    in_process(
        mitigation_address=f"127.0.0.1:{port}",
        mitigation_token_file=token_file(tmp_path),
        rollout_levels=parse_rollout_levels("share=0;share=1"),
    )
    url = f"http://127.0.0.1:{port}"
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service"):
        post(url, notification(alert(fingerprint=forged_fingerprint)))  # starts, pages: demotes to level 1
        post(url, notification(alert(forged_name, fingerprint="0f0f0f0f0f0f0f0f")))  # pages: no lower level
        post(url, notification(alert(status="resolved", fingerprint=forged_fingerprint)))  # ends
    markers = ("MITIGATION_START", "MITIGATION_END", "ROLLOUT_DEMOTED:", "ROLLOUT_DEMOTION_SKIPPED:")
    lines = {m: r.getMessage() for r in caplog.records for m in markers if r.getMessage().startswith(m + " ")}
    assert len(lines) == 4, caplog.text
    assert all(line.isprintable() for line in lines.values()), lines  # no newline, escape or separator
    started = logfmt_fields(lines["MITIGATION_START"], "MITIGATION_START")
    assert (started["fingerprint"], started["model"], started["action"]) == (
        forged_fingerprint,
        MODEL_NAME,
        "shadow_rate=1",
    )
    ended = logfmt_fields(lines["MITIGATION_END"], "MITIGATION_END")
    assert (ended["fingerprint"], ended["reason"]) == (forged_fingerprint, "resolved")
    demoted = logfmt_fields(lines["ROLLOUT_DEMOTED:"], "ROLLOUT_DEMOTED:")
    assert demoted == {
        "from_level": "2",
        "to_level": "1",
        "conditions": "share=0",
        "reason": "LayerwatchRoutingStatic fired",
    }
    skipped = logfmt_fields(lines["ROLLOUT_DEMOTION_SKIPPED:"], "ROLLOUT_DEMOTION_SKIPPED:")
    assert skipped == {"level": "1", "reason": f"{forged_name} fired", "why": "no lower level"}


def test_a_malformed_label_name_cannot_forge_a_log_line(receiver, caplog):
    """The 400's problem names where it is, a label's name included (a webhook's, not bounded in
    length nor characters): it reaches the refusal's log line escaped, as the values above do."""
    url, _, _ = receiver
    forged = "x\nMITIGATION_END alertname=X fingerprint=f reason=operator"
    body = json.loads(notification(alert()))
    body["alerts"][0]["labels"][forged] = 7  # not a string: the problem names the label
    with caplog.at_level(logging.WARNING, logger="layerwatch.inference_shim.service"):
        response = post(url, json.dumps(body).encode())
    assert response.status_code == 400
    assert json.dumps(forged)[1:-1] in response.json()["error"]  # still named, escaped
    refused = [r.getMessage() for r in caplog.records if "refused (400 malformed)" in r.getMessage()]
    assert len(refused) == 1 and refused[0].isprintable(), caplog.text


# --- `layerwatch serve` as a process -----------------------------------------------------------------


def serve(tmp_path: Path, checkpoint, *args: str) -> ManagedProcess:
    argv = [*LAYERWATCH_COMMAND, "serve", "--model", str(checkpoint.path), "--model-name", MODEL_NAME]
    argv += ["--exporter-address", "", "--log-level", "info", *args]
    return ManagedProcess("serve", argv, tmp_path / "serve.log", env={"OMP_NUM_THREADS": "1"})


def test_a_shutdown_ends_the_mitigations_in_effect_in_the_log(tiny_checkpoint, tmp_path):
    """A log audit pairs every MITIGATION_START with a MITIGATION_END: SIGTERM ends those in effect."""
    api, receiver = free_port(), free_port()
    process = serve(
        tmp_path,
        tiny_checkpoint,
        *("--port", str(api), "--mitigation-address", f"127.0.0.1:{receiver}"),
        *("--mitigation-token-file", str(token_file(tmp_path)), "--drain-timeout-seconds", "0"),
    )
    try:
        process.wait_http(f"http://127.0.0.1:{api}/healthz", timeout=90)
        drift = alert("LayerwatchEntropyDrift", fingerprint="0f0f0f0f0f0f0f0f")
        response = post(f"http://127.0.0.1:{receiver}", notification(alert(), drift))
        assert response.json() == {"outcomes": ["started", "started"]}
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(30) == -signal.SIGTERM
    finally:
        process.stop()
    log = process.log_path.read_text()
    ended = [line for line in log.splitlines() if "MITIGATION_END" in line]
    assert len(ended) == 2, log
    assert all(line.endswith(" reason=shutdown requests_left=100") for line in ended), ended


@pytest.mark.parametrize(
    "taken, what, flag",
    [("mitigation", "the mitigation receiver", "--mitigation-address"), ("api", "the API", "--host/--port")],
)
def test_a_taken_port_stops_serve_before_the_model_loads(tiny_checkpoint, tmp_path, taken, what, flag):
    """Exit 2 naming the flag and the address before the model loads (minutes for a real model),
    and so before either listener serves anything."""
    with socket.socket() as occupied:
        occupied.bind(("127.0.0.1", 0))
        occupied.listen()
        port = occupied.getsockname()[1]
        api, receiver = (port, free_port()) if taken == "api" else (free_port(), port)
        process = serve(
            tmp_path,
            tiny_checkpoint,
            *("--port", str(api), "--mitigation-address", f"127.0.0.1:{receiver}"),
            *("--mitigation-token-file", str(token_file(tmp_path))),
        )
        try:
            assert process.proc.wait(60) == 2
        finally:
            process.stop()
    log = process.log_path.read_text()
    assert f"{what} cannot listen on 127.0.0.1:{port} ({flag}): Address already in use" in log, log
    assert "loading the model" not in log, log


def test_a_notification_still_arriving_at_shutdown_starts_no_mitigation(tiny_checkpoint, tmp_path):
    """ShimService.stop closes the receiver's listener, then ends the mitigations. A notification
    whose body was still arriving must not start a mitigation that no MITIGATION_END will ever
    pair: its connection is closed unanswered, and Alertmanager retries it (another replica, or
    this one restarted). One already being applied when the end comes is refused: its
    Mitigations.apply raises ShuttingDown."""
    from layerwatch.inference_shim.service.shim import ServeSettings, ShimService

    settings = ServeSettings(
        model_dir=tiny_checkpoint.path,
        model_name=MODEL_NAME,
        exporter_address="",
        mitigation_address="127.0.0.1:0",
        mitigation_token_file=token_file(tmp_path),
    )
    service = ShimService.load(settings)
    service.start()
    assert service.mitigation_receiver is not None
    body = notification(alert())
    with socket.create_connection(service.mitigation_receiver.address, timeout=10) as client:
        client.sendall(authenticated_head(len(body)) + body[:10])
        time.sleep(0.3)  # its head screened: the listener reads the body
        service.stop()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            client.sendall(body[10:])
        assert whole_answer(client) == b""
    assert service.mitigations.in_effect() == []


def test_a_port_another_starting_serve_holds_stops_serve_before_the_model_loads(tiny_checkpoint, tmp_path):
    """Another `serve` still loading its model holds its port bound, not listening: on Linux two
    SO_REUSEADDR sockets may both bind a port until one listens, so the second start loaded its
    model (minutes) and only then failed, in uvicorn, at listen."""
    other = reserve(("127.0.0.1", 0))  # as a starting serve reserves its ports
    port = other.getsockname()[1]
    try:
        process = serve(tmp_path, tiny_checkpoint, "--port", str(port))
        try:
            code = process.proc.wait(60)
        finally:
            process.stop()
    finally:
        other.close()
    log = process.log_path.read_text()
    assert code == 2, log
    assert f"the API cannot listen on 127.0.0.1:{port} (--host/--port): Address already in use" in log, log
    assert "loading the model" not in log, log


def test_a_reserved_port_with_connections_in_time_wait_still_serves():
    """A restarted receiver's port still has its last connections in TIME_WAIT: reserve binds
    with SO_REUSEADDR, held alone until it listens, and listens with it again."""
    first = MitigationReceiver(reserve(("127.0.0.1", 0)), mitigations()[0], lambda: TOKEN)
    first.start()
    host, port = first.address
    assert post(f"http://{host}:{port}", notification(alert())).status_code == 200  # its connection: TIME_WAIT
    first.stop()
    second = MitigationReceiver(reserve((host, port)), mitigations()[0], lambda: TOKEN)
    second.start()
    try:
        assert post(f"http://{host}:{port}", notification(alert())).status_code == 200
    finally:
        second.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_on_port_0_logs_the_port_it_serves_on(tiny_checkpoint, tmp_path, host):
    """uvicorn given a bound socket does not log where it runs: the start's own line must say it."""
    process = serve(tmp_path, tiny_checkpoint, "--host", host, "--port", "0")
    try:
        deadline, found = time.monotonic() + 60, None
        while found is None and time.monotonic() < deadline and process.proc.poll() is None:
            found = re.search(r"serving .* on (http://\S+:(\d+))$", process.log_path.read_text(), re.MULTILINE)
            time.sleep(0.1)
        assert found is not None and found.group(2) != "0", process.log_path.read_text()
        assert httpx.get(f"{found.group(1)}/healthz", timeout=10).status_code == 200
    finally:
        process.stop()
