"""`layerwatch vllm-guard`'s settings, each declared once (layerwatch/settings.py): its flags come from here."""

from __future__ import annotations

from dataclasses import dataclass

from layerwatch import argtypes
from layerwatch.ports import LOOPBACK, VLLM_GUARD_PORT, VLLM_HTTP_PORT
from layerwatch.settings import drain_timeout_setting, log_level_setting, setting

# The rate the deploys give the shim (docker-compose.yml, the Kubernetes base): a guard is run to check.
DEFAULT_SHADOW_RATE = 0.05


@dataclass(frozen=True, kw_only=True)
class GuardSettings:
    upstream: str = setting(
        f"http://{LOOPBACK}:{VLLM_HTTP_PORT}",
        type=argtypes.server_url(""),
        metavar="URL",
        help="the `vllm serve` the guard fronts (default %(default)s)",
    )
    listen: tuple[str, int] = setting(
        f"{LOOPBACK}:{VLLM_GUARD_PORT}",
        type=argtypes.listen_address,
        metavar="HOST:PORT",
        help="where clients reach vLLM through the guard; its /metrics (default %(default)s)",
    )
    served_model_name: str = setting(
        required=True,
        metavar="NAME",
        help="vLLM's --served-model-name: the metrics' model_name",
    )
    shadow_rate: float = setting(
        DEFAULT_SHADOW_RATE,
        type=argtypes.fraction,
        help='share of generation requests checked at full depth (docs/vllm.md, "Quality guard"; default %(default)s)',
    )
    drain_timeout_seconds: float = drain_timeout_setting()
    log_level: str = log_level_setting()
