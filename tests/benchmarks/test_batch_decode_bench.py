"""benchmarks/batch_decode_bench.py on a tiny model: its tables, the GPU one included, run on the CPU.

The GPU section otherwise runs only where CUDA is present (never in CI); `gpu_section` takes its
device, so here it runs on torch.device("cpu") with what NVML offers on this machine.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import numpy as np
import pytest
import torch

from benchmarks.batch_decode_bench import cpu_section, gpu_energy, gpu_section, metered_decode_run, row_costs
from benchmarks.decode_bench import build_model
from layerwatch.inference_shim.runtime.checkpoint import save_checkpoint
from layerwatch.inference_shim.runtime.model import KV_POLICIES
from layerwatch.inference_shim.runtime.tokenizer import Tokenizer
from tests.model.conftest import build_backend_tokenizer, random_model, tiny_config

MODELS = [(2, 64)]  # layers x d: the smallest build_model makes (one attention head of 64)
BATCHES = [1, 2]
STEPS = 2
# repeats 2: the ratios print their spread; bfloat16, the GPU section's default, on the CPU too
ARGS = argparse.Namespace(
    steps=STEPS, repeats=2, compile=False, gpu_dtype="bfloat16", dtype="float32", quantization="none"
)


def recorded_masks() -> np.ndarray:
    """Run masks [steps, rows, 16] as demo_run_masks returns them; theirs come from the demo model,
    any pattern does for the tables' form."""
    return np.random.default_rng(0).random((STEPS, max(BATCHES), 16)) < 0.7


def table(output: str) -> list[list[str]]:
    """The cells of each row of the markdown table in `output`, every row as wide as its header."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    rows = [line for line in lines[header + 2 :] if line.startswith("|")]
    for row in rows:
        assert row.count("|") == lines[header].count("|"), row
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def numbers(cells: list[str]) -> list[float]:
    """Each cell's figure: "24.5%", "1.23" or a ratio with its spread, "1.23 (1.10–1.31)", whose
    median must lie within the spread."""
    values = []
    for cell in cells:
        figure, _, bracket = cell.partition(" (")
        values.append(float(figure.removesuffix("%")))
        if bracket:
            low, high = (float(end) for end in bracket.removesuffix(")").split("–"))
            assert low - 0.005 <= values[-1] <= high + 0.005, cell
    assert all(math.isfinite(v) for v in values), cells
    return values


def test_gpu_section_without_nvml_prints_no_energy(capsys: pytest.CaptureFixture[str]) -> None:
    energy = gpu_energy(torch.device("cuda", 0))  # the real NVML probe: fails without a GPU
    if energy is not None:
        pytest.skip("NVML works on this machine: the absent-NVML path cannot be taken here")
    assert "(no GPU energy: " in capsys.readouterr().out

    gpu_section(recorded_masks(), MODELS, BATCHES, ARGS, torch.device("cpu"), energy)

    rows = table(capsys.readouterr().out)
    assert [row[:2] for row in rows] == [["2 x 64", "1"], ["2 x 64", "2"]]
    for row in rows:
        # the row-partial limit, skipped decided and executed, whole-batch, w, tokens/s full and gated,
        # the three ratios
        limit, *_ = numbers(row[2:12])
        assert 0 <= limit < int(row[1])
        assert row[12:] == ["n/a", "n/a"]  # J/token full, gated


def test_gpu_section_energy_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    """The J/token arithmetic only: a counter that every reading advances by 6 J stands in for
    NVML's total-energy counter (no real energy is measured), so each metered decode of `batch`
    rows x STEPS tokens uses 6 J: 6 / (batch x STEPS) J per token, at full depth and gated alike."""
    readings = itertools.count(1000.0, 6.0)

    gpu_section(recorded_masks(), MODELS, BATCHES, ARGS, torch.device("cpu"), lambda: next(readings))

    rows = table(capsys.readouterr().out)
    assert [row[1] for row in rows] == ["1", "2"]
    for row in rows:
        per_token = f"{6 / (int(row[1]) * STEPS):.3g}"
        assert row[12:] == [per_token, per_token]


def test_cpu_section(capsys: pytest.CaptureFixture[str]) -> None:
    cpu_section(recorded_masks(), MODELS, BATCHES, ARGS, quality=None)  # no demo decoding: n/a

    output = capsys.readouterr().out
    assert "2 x 64, project: row-partial up to B=1: 0, B=2: " in output  # the measured limits, per KV policy
    rows = table(output)
    assert [row[:3] for row in rows] == [["2 x 64", str(b), kv] for b in BATCHES for kv in KV_POLICIES]
    for row in rows:
        limit, decided, executed, unneeded, *_ = numbers(row[3:16])
        assert 0 <= limit < int(row[1]) and 0 <= unneeded <= decided
        assert row[16:] == ["n/a", "n/a"]  # the demo perplexity columns


def test_the_measurements_run_a_model_in_the_precision_it_was_built_in() -> None:
    # --dtype bfloat16 --quantization int8: the caches take the model's dtype (they were float32 always).
    model = build_model(2, 64, 8192, "bfloat16", "int8")
    assert set(row_costs(model, [1, 2], repeats=1)) == {1, 2}
    assert metered_decode_run(model, None, 2, STEPS, "project").seconds > 0


def test_decode_bench_refuses_a_checkpoint_its_precision_cannot_load_in_one_line(
    tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unguarded, `decode_bench.py --model DIR` of a folder that is not a checkpoint, or
    with a --quantization its widths cannot take, ends in a traceback."""
    from benchmarks import decode_bench

    tokenizer = Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True)
    save_checkpoint(random_model(tiny_config(num_heads=3, num_kv_heads=1)), tokenizer, tmp_path / "odd")
    for flags, reason in [
        (["--model", str(tmp_path / "missing")], "not a directory (expected a Hugging Face checkpoint folder)"),
        (["--model", str(tmp_path / "odd"), "--quantization", "int8"], "num_heads * head_dim is 24 (use none)"),
    ]:
        monkeypatch.setattr(sys, "argv", ["decode_bench.py", *flags])
        with pytest.raises(SystemExit) as refused:
            decode_bench.main()
        assert refused.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(reason)


def test_precision_bench_refuses_a_precision_it_cannot_load_in_one_line(
    tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unguarded, `precision_bench.py --precisions float64+int8` ends in a KeyError
    traceback."""
    from benchmarks import precision_bench

    tokenizer = Tokenizer(build_backend_tokenizer(), bos_token="<s>", eos_tokens=["</s>"], add_bos_token=True)
    save_checkpoint(random_model(tiny_config(num_heads=3, num_kv_heads=1)), tokenizer, tmp_path / "odd")
    for precision, reason in [
        ("float64+int8", "'float64+int8' is not DTYPE or DTYPE+QUANTIZATION"),
        ("float32+int5", "'float32+int5' is not DTYPE or DTYPE+QUANTIZATION"),
        ("float32+int8", "num_heads * head_dim is 24 (use none)"),
    ]:
        argv = ["precision_bench.py", "--model", str(tmp_path / "odd"), "--data", "x.txt", "--precisions", precision]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as refused:
            precision_bench.main()
        assert refused.value.code == 2
        assert reason in capsys.readouterr().err.strip().splitlines()[-1]
