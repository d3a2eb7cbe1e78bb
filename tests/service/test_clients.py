"""The clients people already use, each with its default settings, against a live `layerwatch serve`
on the demo model: LangChain, litellm, guidellm and aiperf (benchmarks) and lm-eval's
`local-completions` (a humaneval-style generate-until task with its five stop strings, a
generate-until and a loglikelihood task over local data, and perplexity through the API, which
must agree with `layerwatch eval`'s gated figure on the same text; lm-eval's request made
directly to a server at threshold 0 gives eval's full-depth one). lm-eval is given no tokenizer:
it finds the server's (`/tokenizer_info`, `/tokenize`). Nothing is downloaded: the tokenizer the
benchmarks load is the demo model's folder, the data sets are files the tests write. The test
command installs every client (litellm in pyproject.toml's `test` extra, aiperf in .venv-aiperf by
scripts/setup-aiperf.sh; docs/service.md, "Clients"); one that is not installed is skipped.

(The official `openai` client is in test_openai_api.py and test_openai_fields.py.)
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from layerwatch.demo.processes import ManagedProcess, free_port
from layerwatch.inference_shim.runtime.demo_model import DEMO_MODEL_DIR
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from tests.support import sample_sum, scrape

AIPERF_ENV = Path(__file__).resolve().parents[2] / ".venv-aiperf"

DEMO_NAME = "layerwatch-demo"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
GENESIS = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters."
)


def serve_demo(work: Path, *options: str) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "layerwatch.cli.main", "serve", "--port", str(port), "--exporter-address", ""]
    process = ManagedProcess("serve", [*argv, *options], work / "serve.log", env={"OMP_NUM_THREADS": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{base_url}/health", timeout=120)
        yield base_url
    finally:
        process.stop()


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory) -> Iterator[str]:
    """The demo model at its gates' own threshold, where layers really are skipped."""
    yield from serve_demo(tmp_path_factory.mktemp("clients"))


@pytest.fixture(scope="module")
def full_depth_server(tmp_path_factory) -> Iterator[str]:
    yield from serve_demo(tmp_path_factory.mktemp("clients-full"), "--threshold", "0")


def test_langchain_chat_openai_keeps_to_max_tokens(demo_server):
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(model=DEMO_NAME, base_url=f"{demo_server}/v1", api_key="x", max_tokens=8, max_retries=0)
    answer = chat.invoke("And God said, Let there be light")
    assert 0 < answer.usage_metadata["output_tokens"] <= 8  # sent as max_completion_tokens
    assert answer.usage_metadata["output_tokens"] == 8 or answer.response_metadata["finish_reason"] == "stop"
    llm = OpenAI(model=DEMO_NAME, base_url=f"{demo_server}/v1", api_key="x", max_tokens=6, max_retries=0)
    texts = llm.batch(["In the beginning", "And the evening and the morning"])  # one request, two prompts
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_litellm_chat_and_text_completion(demo_server):
    litellm = pytest.importorskip("litellm")
    options = dict(api_base=f"{demo_server}/v1", api_key="x", max_tokens=6, num_retries=0)
    messages = [{"role": "user", "content": "And God said"}]
    chat = litellm.completion(model=f"hosted_vllm/{DEMO_NAME}", messages=messages, temperature=0.8, **options)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 6
    streamed = litellm.completion(model=f"hosted_vllm/{DEMO_NAME}", messages=messages, stream=True, **options)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    text = litellm.text_completion(model=f"hosted_vllm/{DEMO_NAME}", prompt="In the beginning", **options)
    assert text.choices[0].text and text.usage.completion_tokens <= 6


def test_bad_words_keep_the_word_out_of_sampled_chats(demo_server):
    """The issue's case: `bad_words: [" the"]` and " the" never appears, in sampled chats of a model
    that says it all the time (seeded: the same draws each run)."""
    import openai

    client = openai.OpenAI(base_url=f"{demo_server}/v1", api_key="x", max_retries=0, timeout=60)
    request = dict(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "And God said, Let there be light"}],
        max_tokens=32,
        temperature=0.8,
        n=4,
        seed=11,
    )
    the = re.compile(r" the\b")  # the word, not " there" or " them" (other words, other tokens)
    free = client.chat.completions.create(**request)
    assert any(the.search(c.message.content) for c in free.choices)  # the test can tell
    banned = client.chat.completions.create(**request, extra_body={"bad_words": [" the"]})
    assert not any(the.search(c.message.content) for c in banned.choices), [c.message.content for c in banned.choices]


def test_aiperf_streamed_chat_profile(demo_server, tmp_path):
    # aiperf pins older versions of packages this venv holds (docs/service.md, "Clients"): the test
    # command installs it in an environment of its own (scripts/setup-aiperf.sh); else found on PATH.
    aiperf = shutil.which("aiperf", path=os.pathsep.join([str(AIPERF_ENV / "bin"), os.environ.get("PATH", "")]))
    if aiperf is None:
        pytest.skip("aiperf is not installed (scripts/setup-aiperf.sh)")
    command = [aiperf, "profile", "--model", DEMO_NAME, "--url", demo_server, "--endpoint-type", "chat", "--streaming"]
    command += ["--tokenizer", str(DEMO_MODEL_DIR), "--request-count", "4", "--concurrency", "2"]
    command += ["--prompt-input-tokens-mean", "16", "--prompt-output-tokens-mean", "8"]
    command += ["--extra-inputs", "ignore_eos:true", "--output-artifact-dir", str(tmp_path), "--ui-type", "none"]
    # The server's `usage` counts the tokens generated; aiperf's own count re-tokenizes the streamed text, where
    # two sampled tokens can come back as one.
    command += ["--use-server-token-count"]
    before = scrape(demo_server)
    # Not OFFLINE: aiperf 0.13 in offline mode looks a tokenizer folder up in the hub cache; a local
    # folder needs no network otherwise.
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = scrape(demo_server)
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 4 and not report["error_summary"]
    assert report["output_sequence_length"]["min"] == report["output_sequence_length"]["max"] == 8
    served = {
        status: sample_sum(after, "layerwatch_requests_total", status=status)
        - sample_sum(before, "layerwatch_requests_total", status=status)
        for status in ("ok", "client_error", "server_error")
    }
    assert served == {"ok": 4, "client_error": 0, "server_error": 0}


def test_guidellm_synchronous_and_concurrent_runs_get_the_tokens_they_ask(demo_server, tmp_path):
    report = tmp_path / "benchmarks.json"
    command = [
        str(Path(sys.executable).with_name("guidellm")),
        "run",
        "--backend",
        f"kind=openai_http,target={demo_server}",
        "--profile",
        json.dumps({"kind": "concurrent", "streams": [1, 3]}),  # 1 stream: synchronous
        "--constraint",
        "kind=max_requests,count=4",
        "--data",
        "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--tokenizer",
        f"kind=huggingface_auto,model={DEMO_MODEL_DIR}",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    before = scrape(demo_server)
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE}, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = scrape(demo_server)
    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benchmarks] == [1, 3]
    successful = [benchmark["requests"]["successful"] for benchmark in benchmarks]
    for benchmark in benchmarks:
        assert not benchmark["requests"]["errored"] and not benchmark["requests"]["incomplete"]
    assert all(r["output_metrics"]["text_tokens"] == 8 for rs in successful for r in rs)
    # The synchronous run completes its 4. At 3 streams guidellm stops on its 4th *processed*
    # request and may drop one it queued but never sent (its accumulator ignores requests
    # cancelled before they start), so that run reports 3 or 4; the server's own count says
    # whether every request it was sent succeeded.
    assert len(successful[0]) == 4 and 3 <= len(successful[1]) <= 4
    served = {
        status: sample_sum(after, "layerwatch_requests_total", status=status)
        - sample_sum(before, "layerwatch_requests_total", status=status)
        for status in ("ok", "client_error", "server_error", "cancelled")
    }
    assert served == {
        "ok": len(successful[0]) + len(successful[1]),
        "client_error": 0,
        "server_error": 0,
        "cancelled": 0,
    }


# --- lm-eval ------------------------------------------------------------------------------------------


def lm_eval(server: str, work: Path, tasks: dict[str, tuple[dict, list[dict]]]) -> dict:
    """Run lm-eval's local-completions with its defaults on task YAMLs, each over its own local jsonl
    file; -> its results. No tokenizer is given: lm-eval finds the server's; only the prefix token of
    empty contexts is named (below). All tasks in one run: each run pays lm-eval's start-up again."""
    import yaml

    for name, (fields, docs) in tasks.items():
        data = work / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            **fields,
        }
        (work / f"{name}.yaml").write_text(yaml.safe_dump(task))
    # lm-eval 0.4.13's remote tokenizer takes `bos_token_id or eos_token_id` for the token it puts
    # before an empty context, which is EOS for a BOS of id 0 (the demo's): name it (docs/service.md).
    bos = Tokenizer.from_files(DEMO_MODEL_DIR / "tokenizer.json", DEMO_MODEL_DIR / "tokenizer_config.json").bos_token_id
    model_args = f"model={DEMO_NAME},base_url={server}/v1/completions,custom_prefix_token_id={bos}"
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(work),
        "--output_path",
        str(work / "out"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE}, cwd=work)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Using remote tokenizer" in run.stdout + run.stderr
    (results_file,) = (work / "out").rglob("results_*.json")
    return json.loads(results_file.read_text())["results"]


GENERATE_AND_CHOICE_DOCS = [
    {"prompt": "In the beginning God created", "answer": " the heaven", "choices": [" the heaven", " a fish"]},
    {"prompt": "And God said, Let there be", "answer": " light", "choices": [" light", " stones"]},
]
# humaneval's generation settings (lm_eval/tasks/humaneval/humaneval.yaml) over local prompts: five
# stop strings, to which lm-eval adds the EOS text (six in all: the old limit was OpenAI's 4), and
# lm-eval's default max_gen_toks (humaneval's own 1,024 is more than the demo's whole context).
HUMANEVAL_STYLE_TASK = {
    "layerwatch_humaneval_style": (
        {
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"], "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
        [{"prompt": "def light():\n    return", "answer": " 1"}, {"prompt": "And God said", "answer": " Let"}],
    )
}
GENERATE_AND_CHOICE_TASKS = {
    "layerwatch_generate": (
        {
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
        GENERATE_AND_CHOICE_DOCS,
    ),
    "layerwatch_choice": (
        {
            "output_type": "multiple_choice",
            "doc_to_text": "{{prompt}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": 0,
            "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
        GENERATE_AND_CHOICE_DOCS,
    ),
}
# lm-eval scores the text after the BOS token (its prefix token for an empty context) from the
# served prompt log-probabilities.
PERPLEXITY_TASK = {
    "layerwatch_perplexity": (
        {
            "output_type": "loglikelihood",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "target_delimiter": "",
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
        },
        [{"text": GENESIS}],
    )
}


@pytest.fixture(scope="module")
def demo_lm_eval(demo_server, tmp_path_factory) -> dict:
    """lm-eval's results from the gated server: every task in one run."""
    tasks = {**HUMANEVAL_STYLE_TASK, **GENERATE_AND_CHOICE_TASKS, **PERPLEXITY_TASK}
    return lm_eval(demo_server, tmp_path_factory.mktemp("lm-eval"), tasks)


@pytest.fixture(scope="module")
def full_depth_loglikelihood(full_depth_server) -> float:
    """The text's log-likelihood from the server at threshold 0, asked as lm-eval's
    local-completions asks it (the token ids of BOS and text, echoed with their log-probabilities,
    nothing generated, the text's summed): lm-eval itself is run against the gated server, and a
    second run of it here cost 16 s of the suite for the same client code path."""
    tokenizer = Tokenizer.from_files(DEMO_MODEL_DIR / "tokenizer.json", DEMO_MODEL_DIR / "tokenizer_config.json")
    text = tokenizer.encode(GENESIS, add_special_tokens=False)
    body = {"model": DEMO_NAME, "prompt": [tokenizer.bos_token_id, *text], "max_tokens": 0, "temperature": 0}
    response = httpx.post(
        f"{full_depth_server}/v1/completions", json={**body, "logprobs": 1, "echo": True}, timeout=120
    )
    assert response.status_code == 200, response.text
    scores = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scores) == len(text) + 1 and scores[0] is None  # BOS (nothing precedes it), then the text
    return math.fsum(scores[1:])


@pytest.fixture(scope="module")
def genesis_eval(tmp_path_factory) -> dict:
    """`layerwatch eval` on the same tokens lm-eval sends: one window of BOS + text, prefilling the
    BOS only, at the gates' own threshold; it reports the full-depth perplexity beside the gated one."""
    from layerwatch.inference_shim.runtime.checkpoint import load_checkpoint
    from layerwatch.inference_shim.runtime.gates import gates_path_for, load_gates

    checkpoint = load_checkpoint(DEMO_MODEL_DIR)
    threshold = load_gates(gates_path_for(DEMO_MODEL_DIR), checkpoint.model).metadata.threshold
    tokens = len(checkpoint.tokenizer.encode(GENESIS, add_special_tokens=False))
    text = tmp_path_factory.mktemp("genesis") / "genesis.txt"
    text.write_text(GENESIS + "\n")
    command = [sys.executable, "-m", "layerwatch.cli.main", "eval", "--data", str(text), "--json", "--repeats", "1"]
    command += ["--window", str(tokens + 1), "--prefill", "1", "--max-tokens", str(tokens)]
    command += ["--threshold", str(threshold)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["windows"] == 1 and report["decoded_tokens"] == tokens
    assert report["skip_fraction"] > 0.1  # layers really were skipped on this text
    return {**report, "threshold": threshold, "tokens": tokens}


def test_lm_eval_generate_until_and_loglikelihood_tasks(demo_lm_eval):
    assert 0.0 <= demo_lm_eval["layerwatch_humaneval_style"]["exact_match,none"] <= 1.0
    assert 0.0 <= demo_lm_eval["layerwatch_generate"]["exact_match,none"] <= 1.0
    assert demo_lm_eval["layerwatch_choice"]["acc,none"] == 1.0  # the demo model knows its Genesis


@pytest.mark.parametrize("server", ["full_depth", "demo"])
def test_lm_eval_perplexity_agrees_with_layerwatch_eval(server, request, genesis_eval):
    """Perplexity through the API agrees with `layerwatch eval` on the same tokens: its gated figure
    (not the full-depth one) through lm-eval for the server at the gates' own threshold, its
    full-depth one for the server at threshold 0 (asked as lm-eval asks)."""
    if server == "demo":
        # lm-eval's perplexity is exp(-mean document log-likelihood): one document here.
        loglikelihood = -math.log(request.getfixturevalue("demo_lm_eval")["layerwatch_perplexity"]["perplexity,none"])
    else:
        loglikelihood = request.getfixturevalue("full_depth_loglikelihood")
    through_api = math.exp(-loglikelihood / genesis_eval["tokens"])
    expected, other = (
        ("perplexity_full", "perplexity_gated") if server == "full_depth" else ("perplexity_gated", "perplexity_full")
    )
    print(
        f"{server} server: perplexity over {genesis_eval['tokens']} tokens: via the API {through_api:.9f}, "
        f"eval gated {genesis_eval['perplexity_gated']:.9f} (threshold {genesis_eval['threshold']}), "
        f"full depth {genesis_eval['perplexity_full']:.9f}"
    )
    assert through_api == pytest.approx(genesis_eval[expected], rel=1e-6)
    assert through_api != pytest.approx(genesis_eval[other], rel=1e-3)
