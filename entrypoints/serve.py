"""`layerwatch serve`: the gated model behind an OpenAI-compatible API, with metrics and gate frames.

Every flag is also read from LAYERWATCH_<FLAG> (see entrypoints/main.py). docs/service.md has the
details: API, metrics semantics, gate frames, shadow checks, readiness and security notes.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from inference_shim.runtime.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME

LOG_LEVELS = ("debug", "info", "warning", "error")


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="Hugging Face checkpoint folder (default: the embedded demo model)")
    model.add_argument("--gates", type=Path, default=None, metavar="FILE",
                       help="gate weights (default: DIR/gates.safetensors)")
    model.add_argument("--model-name", default=None,
                       help=f"name clients use and metrics carry (default: the folder's name; "
                            f"{DEMO_MODEL_NAME} for the demo model)")
    model.add_argument("--reset-gates", action="store_true",
                       help="serve freshly initialised gates instead of the gate file: simulates the 'gate "
                            "weights overwritten' incident (layerwatch_model_info's gates_sha256 changes)")
    model.add_argument("--gates-watch-seconds", type=float, default=5.0, metavar="S",
                       help="check the gate file for a replacement this often: a complete, valid one is swapped in "
                            "between decode steps, anything else is rejected and the loaded gates keep serving "
                            "(0: never; default %(default)s)")
    model.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    model.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))

    policy = parser.add_argument_group("skipping")
    policy.add_argument("--threshold", type=_fraction, default=None,
                        help="skip threshold on the gate entropy (default: the gate file's calibrated value)")
    policy.add_argument("--patience", type=int, default=None,
                        help="consecutive tokens below the threshold before a layer is skipped (default: the "
                             "gate file's)")
    policy.add_argument("--protected-layers", type=_layers, default=None, metavar="L,L,...",
                        help="layers never skipped (default: the first and the last)")
    policy.add_argument("--kv-policy", default="project", choices=("project", "evict"),
                        help="what the KV cache holds for a skipped layer: K/V projected from its input, or "
                             "nothing (the position is left out of that layer's attention)")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--max-batch-size", type=int, default=8,
                        help="sequences decoded together; new requests join at step boundaries")
    server.add_argument("--max-tokens-cap", type=int, default=None,
                        help="largest max_tokens a request may ask for (default: 512, or less to fit the "
                             "model's context)")
    server.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest prompt accepted, in tokens (default: 1024, or less to fit the model's "
                             "context with the cap)")
    server.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    server.add_argument("--body-timeout-seconds", type=float, default=30.0,
                        help="a request body must arrive within this many seconds, else 408 (slow clients)")
    server.add_argument("--allow-debug", action="store_true",
                        help="honour the x-layerwatch-debug request header (returns per-token layer activity)")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS)

    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument("--exporter-address", default="127.0.0.1:9410", metavar="HOST:PORT",
                           help="where gate frames go over UDP (empty: no frames)")
    telemetry.add_argument("--shim-id", default=None, help="identifies this process in gate frames "
                                                           "(default: hostname-pid)")
    telemetry.add_argument("--trace-file", type=Path, default=None,
                           help="also write every decoded token's scores and skips as a JSON Lines trace")
    telemetry.add_argument("--trace-max-bytes", type=int, default=100 << 20,
                           help="stop writing the trace file at this size")
    telemetry.add_argument("--shadow-rate", type=_fraction, default=0.0,
                           help="share of finished greedy requests re-scored at full depth (quality guard)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("layerwatch.serve")

    import uvicorn

    from inference_shim.runtime.checkpoint import CheckpointError
    from inference_shim.runtime.gates import GateFileError
    from inference_shim.service.app import create_app
    from inference_shim.service.shim import ServeSettings, ShimService

    model_dir = args.model or DEMO_MODEL_DIR
    if args.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
        log.error("cannot start: the demo model is not in %s; build it with `layerwatch train-demo` or pass "
                  "--model DIR", DEMO_MODEL_DIR)
        return 2
    settings = ServeSettings(
        model_dir=model_dir, gates_path=args.gates,
        model_name=args.model_name or (DEMO_MODEL_NAME if args.model is None else None),
        threshold=args.threshold, patience=args.patience, protected_layers=args.protected_layers,
        kv_policy=args.kv_policy, max_batch_size=args.max_batch_size, max_tokens_cap=args.max_tokens_cap,
        max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
        body_timeout_seconds=args.body_timeout_seconds,
        exporter_address=args.exporter_address, shim_id=args.shim_id, trace_file=args.trace_file,
        trace_max_bytes=args.trace_max_bytes, shadow_rate=args.shadow_rate, allow_debug=args.allow_debug,
        device=args.device, dtype=args.dtype, reset_gates=args.reset_gates,
        gates_watch_seconds=args.gates_watch_seconds)
    try:
        service = ShimService.load(settings)
    except (CheckpointError, GateFileError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    log.info("serving %s (%d layers, gates_sha256=%s) on http://%s:%d", service.model_name,
             service.model.config.num_layers, service.gates_sha256, args.host, args.port)
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
