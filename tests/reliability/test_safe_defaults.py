"""Safe defaults: loopback-only listeners, the debug header off, no secret in the repository.

The containers' non-root USER, the compose file's loopback-only port publishing and Grafana's
password from the environment are checked in tests/stack/test_deploy.py; docs/security.md has
the threat model these defaults serve.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerwatch.cli.main import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def test_every_address_flag_defaults_to_loopback():
    """Every flag of every command whose default is an address (bind or destination) is loopback."""
    checked = []
    for command in COMMANDS:
        parser = build_parser([command], environ={})
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            default = action.default
            if action.dest == "host" or (isinstance(default, str) and re.fullmatch(r"[\w.\-\[\]:]+:\d+", default)):
                host = default if action.dest == "host" else default.rpartition(":")[0].strip("[]")
                checked.append(f"{command} {action.option_strings[0]}")
                assert host in LOOPBACK, f"layerwatch {command} {action.option_strings[0]} defaults to {default}"
    assert {"serve --host", "serve --exporter-address", "exporter --listen", "exporter --http"} <= set(checked)


def test_serve_and_exporter_with_no_address_flags_listen_on_loopback_only(tiny_checkpoint):
    """Both started with their real defaults in a fresh network namespace; every socket they listen
    on, read from /proc, is bound to 127.0.0.1; the debug header is ignored; NVML is down (no GPU
    here) and serving is unaffected."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("needs `unshare -n` (root or user namespaces) to free the default ports")
    script = (
        f"ip link set lo up && exec {sys.executable} -m tests.reliability.default_listeners '{tiny_checkpoint.path}'"
    )
    result = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=150, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"\n{seen}")

    assert seen["serve"] == [{"proto": "tcp", "address": "127.0.0.1", "port": 8000}]
    assert sorted(seen["exporter"], key=lambda s: s["proto"]) == [
        {"proto": "tcp", "address": "127.0.0.1", "port": 9411},
        {"proto": "udp", "address": "127.0.0.1", "port": 9410},
    ]
    assert seen["usage"]["completion_tokens"] == 3
    assert "x-layerwatch-layer-activity" not in seen["response_headers"]  # debug header off by default
    assert seen["nvml_up"] == 0


# --- no secret in the repository --------------------------------------------------------------------

SECRET_PATTERNS = {
    "private key": re.compile(r"-----BEGIN (?:RSA |EC |DSA |OPENSSH |PGP )?PRIVATE KEY"),
    "AWS access key": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "GitHub token": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,}\b"),
    "Slack token": re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),
    "OpenAI key": re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),
    "URL with credentials": re.compile(r"\b[a-z][a-z0-9+.-]*://[^/\s:@]+:[^/\s:@]+@"),
    # A password or secret assigned a literal: "password: hunter2", GF_SECURITY_ADMIN_PASSWORD=x ...
    "assigned password": re.compile(
        r"(?i)(?:password|passwd|secret|api_?key|auth_?token)[\"']?\s*[:=]\s*[\"']?([^\s\"',}?$]{4,})"
    ),
}
# Literal values that name a variable or are a documented placeholder rather than hold a secret.
NOT_SECRETS = re.compile(
    r"^(?:\$|<|os\.environ|environ|None|null|true|false|\*+|only-for-this-test|choose-one"
    r"|change-?me|your-|example|placeholder)",
    re.I,
)


def repository_files() -> list[Path]:
    """What git tracks or would add (ignored files excluded); outside a git checkout, every file but
    the usual local ones."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=REPO,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        return [REPO / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        local = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis"}
        return [p for p in REPO.rglob("*") if not local & set(p.relative_to(REPO).parts)]


def tracked_text_files() -> list[Path]:
    files = []
    for path in repository_files():
        if path.is_file() and path.stat().st_size < 2_000_000 and b"\0" not in path.read_bytes()[:4096]:
            files.append(path)
    return files


def find_secrets(text: str) -> list[str]:
    hits = []
    for kind, pattern in SECRET_PATTERNS.items():
        for match in pattern.finditer(text):
            value = match.group(match.lastindex or 0)
            if kind == "assigned password" and NOT_SECRETS.match(value):
                continue
            hits.append(f"{kind}: {match.group(0)[:60]!r}")
    return hits


def test_the_secret_scan_finds_planted_secrets():
    """The scanner below is only worth something if it catches the real thing."""
    planted = {
        "-----BEGIN OPENSSH PRIVATE KEY-----": "private key",
        "aws = AKIAABCDEFGHIJKLMNOP": "AWS access key",
        "token ghp_" + "a1B2" * 9: "GitHub token",
        "GF_SECURITY_ADMIN_PASSWORD: hunter22": "assigned password",
        'password = "correct-horse"': "assigned password",
        "url: https://admin:s3cret@grafana.example": "URL with credentials",
        "HF_TOKEN=hf_" + "x" * 34: "Hugging Face token",
    }
    for text, kind in planted.items():
        assert any(hit.startswith(kind) for hit in find_secrets(text)), text
    for harmless in (
        'GF_SECURITY_ADMIN_PASSWORD: "${GRAFANA_ADMIN_PASSWORD:?set it}"',
        "password: $GRAFANA_PASSWORD",
        "the admin password comes from the environment",
    ):
        assert find_secrets(harmless) == [], harmless


def test_no_secret_is_in_the_repository():
    """Every file git tracks or would add (not ignored), text only: no key, token or password literal."""
    files = tracked_text_files()
    assert len(files) > 50
    this_file = Path(__file__).resolve()
    found = [
        f"{path.relative_to(REPO)}: {hit}"
        for path in files
        if path.resolve() != this_file
        for hit in find_secrets(path.read_text(errors="replace"))
    ]
    assert found == [], "\n".join(found)
