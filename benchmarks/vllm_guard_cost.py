"""What the quality guard costs a vLLM deployment: served throughput with `layerwatch vllm-guard` in front of vLLM at
its default shadow rate ÷ without it, under sampled chat load. Opt-in, not in the suite.

    python benchmarks/vllm_guard_cost.py --upstream http://127.0.0.1:8000 --served-model-name NAME

The upstream is a running `vllm serve` with layerwatch's plugin, `--scheduling-policy priority` (the re-checks ask
for a low priority). The guard is started here. Rounds alternate between vLLM directly and the guard (interleaved,
so drifting machine load hits both alike); each round sends --requests chat requests (temperature 0.8, prompts in
turn) from --concurrency clients. Every answer is --max-tokens long (vLLM's `ignore_eos`): rounds then differ by what
the engine did, not by where sampling happened to stop. A guard round ends when its answers are in and vLLM has
nothing left to run: the full-depth re-checks it started are paid inside it. Throughput is generated tokens (the
answers' `usage`) per second of wall time, over all rounds of each side. Prints each round, the totals, and last one
JSON line with direct_tokens_per_second, guard_tokens_per_second, ratio, checked (sequences the guard checked),
guard_cpu_share (the guard process's own CPU seconds over the guard rounds' wall time: what it takes from vLLM's
cores when they share a machine), recheck_seconds (one re-check of a typical answer, timed alone on the idle engine)
and ratio_from_rechecks (1 - checked x recheck_seconds / the guard rounds' time: the cost the re-checks imply
without the rounds' noise, which on a shared machine can exceed it).
Goal (issue 42): ratio >= 0.95 at the default rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from layerwatch.demo.processes import ManagedProcess, free_port  # noqa: E402 (the checkout on the path first)
from layerwatch.ports import LOOPBACK  # noqa: E402
from layerwatch.vllm_guard.checker import CHECK_PRIORITY, rescore_body  # noqa: E402
from layerwatch.vllm_guard.settings import DEFAULT_SHADOW_RATE  # noqa: E402

PROMPTS = (
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a child.",
    "List three uses of copper and say why.",
    "Describe a walk through a forest in autumn.",
    "What makes a good cup of tea?",
)


def one_request(base: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body |= {"temperature": 0.8, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


def engine_busy(upstream: str) -> bool:
    text = httpx.get(f"{upstream}/metrics", timeout=30).text
    running = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", text, re.M)
    return sum(float(v) for v in running) > 0


def drained(upstream: str) -> None:
    """Until vLLM has run everything it was given, the re-checks a round started included."""
    idle = 0
    while idle < 3:  # three quiet looks in a row: no re-check between an answer and its submission
        idle = 0 if engine_busy(upstream) else idle + 1
        time.sleep(0.1)


def round_tokens_and_seconds(base: str, upstream: str, args: argparse.Namespace) -> tuple[int, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(lambda p: one_request(base, args.served_model_name, p, args.max_tokens), prompts))
    drained(upstream)
    return tokens, time.perf_counter() - start


def warm_up_log_probabilities(upstream: str, model: str) -> None:
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8}
    chat |= {"logprobs": True, "top_logprobs": 20}
    rescore = {"model": model, "prompt": list(range(1000, 1100)), "max_tokens": 1, "prompt_logprobs": 20}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", rescore)):
        httpx.post(f"{upstream}{path}", json=body, timeout=600).raise_for_status()


def recheck_seconds(upstream: str, args: argparse.Namespace, repeats: int = 3) -> float:
    """The median time of the guard's re-check of one typical answer (a round's prompt and --max-tokens tokens),
    alone on the idle engine."""
    body = {"model": args.served_model_name, "messages": [{"role": "user", "content": PROMPTS[0]}]}
    body |= {"max_tokens": args.max_tokens, "temperature": 0.8, "ignore_eos": True, "return_token_ids": True}
    choice = httpx.post(f"{upstream}/v1/chat/completions", json=body, timeout=600).json()
    tokens = choice["prompt_token_ids"] + choice["choices"][0]["token_ids"]
    times = []
    for _ in range(repeats):
        rescore = {**rescore_body(args.served_model_name, tokens), "priority": CHECK_PRIORITY}
        start = time.perf_counter()
        httpx.post(f"{upstream}/v1/completions", json=rescore, timeout=600).raise_for_status()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)


def checked_sequences(guard: str) -> float:
    text = httpx.get(f"{guard}/metrics", timeout=30).text
    return sum(
        float(v)
        for v in re.findall(r'^layerwatch_shadow_requests_total\{[^}]*outcome="checked"[^}]*\} (\S+)', text, re.M)
    )


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the running `vllm serve` (URL)")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--shadow-rate", type=float, default=DEFAULT_SHADOW_RATE)
    parser.add_argument("--rounds", type=int, default=4, help="per side (default %(default)s)")
    parser.add_argument("--requests", type=int, default=40, help="per round (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=8, help="(default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="(default %(default)s)")
    args = parser.parse_args()
    upstream = args.upstream.rstrip("/")

    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "vllm-guard", "--upstream", upstream]
    argv += ["--listen", f"{LOOPBACK}:{port}", "--served-model-name", args.served_model_name]
    argv += ["--shadow-rate", str(args.shadow_rate)]
    guard = f"http://{LOOPBACK}:{port}"
    process = ManagedProcess("vllm-guard", argv, Path(tempfile.mkdtemp()) / "guard.log")
    try:
        process.wait_http(f"{guard}/metrics", 60)
        totals = {"direct": [0, 0.0], "guard": [0, 0.0]}
        guard_cpu = 0.0
        # Not counted: both sides once, and vLLM's paths for the sampled answers' logprobs and the re-checks' prompt
        # logprobs (their first use costs seconds, which would land in the first guard round alone).
        warm_up = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        for base in (upstream, guard):
            round_tokens_and_seconds(base, upstream, warm_up)
        warm_up_log_probabilities(upstream, args.served_model_name)
        for r in range(args.rounds):
            for side, base in (("direct", upstream), ("guard", guard)):
                cpu_before = cpu_seconds(process.proc.pid)
                tokens, seconds = round_tokens_and_seconds(base, upstream, args)
                if side == "guard":
                    guard_cpu += cpu_seconds(process.proc.pid) - cpu_before
                totals[side][0] += tokens
                totals[side][1] += seconds
                print(f"round {r + 1} {side:6s}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s")
        rates = {side: tokens / seconds for side, (tokens, seconds) in totals.items()}
        checked = checked_sequences(guard)
        ratio = rates["guard"] / rates["direct"]
        cpu_share = guard_cpu / totals["guard"][1]
        recheck = recheck_seconds(upstream, args)
        ratio_from_rechecks = 1 - checked * recheck / totals["guard"][1]
        print(
            f"direct {rates['direct']:.1f} tokens/s, through the guard at shadow rate {args.shadow_rate:g} "
            f"{rates['guard']:.1f} tokens/s ({checked:.0f} sequences checked): ratio {ratio:.3f}; "
            f"the guard process used {guard_cpu:.1f} CPU s, {cpu_share:.1%} of its rounds' wall time"
        )
        print(
            f"a re-check alone: {recheck:.2f} s; {checked:.0f} of them in {totals['guard'][1]:.0f} s of guard rounds: "
            f"ratio {ratio_from_rechecks:.3f} from the re-checks' time"
        )
        print(
            json.dumps(
                {
                    "direct_tokens_per_second": round(rates["direct"], 2),
                    "guard_tokens_per_second": round(rates["guard"], 2),
                    "ratio": round(ratio, 4),
                    "checked": checked,
                    "guard_cpu_share": round(cpu_share, 4),
                    "recheck_seconds": round(recheck, 3),
                    "ratio_from_rechecks": round(ratio_from_rechecks, 4),
                }
            )
        )
    finally:
        process.stop()


if __name__ == "__main__":
    main()
