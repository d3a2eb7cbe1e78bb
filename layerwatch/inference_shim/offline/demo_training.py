"""The embedded demo model, built from scratch (`layerwatch train-demo`).

1. corpus: the KJV from the `bible` program (Debian bible-kjv), every 20th chapter held out;
2. tokenizer: byte-level BPE with `tokenizers`;
3. backbone: a Llama-architecture model trained with layer dropout rising with depth, resumable
   (state in WORKDIR/backbone.pt: rerun the same command to continue after an interruption);
4. export: the Hugging Face folder (config.json, model.safetensors, tokenizer files).

Gates are trained afterwards by `layerwatch train-gates` (docs/gate-training.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from layerwatch.inference_shim.offline import training
from layerwatch.inference_shim.offline.corpus import (
    read_bible,
    read_documents,
    split_chapters,
    split_heldout,
    write_corpus,
)
from layerwatch.inference_shim.runtime.checkpoint import save_checkpoint
from layerwatch.inference_shim.runtime.model import ModelConfig, Transformer


class DemoTrainingError(ValueError):
    """The workdir holds state that cannot be resumed as asked."""


@dataclass(frozen=True)
class DemoShape:
    """The demo backbone's architecture and tokenizer size."""

    layers: int = 16
    hidden_size: int = 128
    intermediate_size: int = 384
    heads: int = 4
    kv_heads: int = 2
    vocab_size: int = 2048


# How the committed demo model was trained (layerwatch/inference_shim/demo_model/README.md).
DEMO_SCHEDULE = training.BackboneSchedule(steps=2500, batch_size=8, seq_len=256)


def train_demo(
    workdir: Path,
    out: Path,
    shape: DemoShape,
    schedule: training.BackboneSchedule,
    *,
    export_only: bool = False,
    checkpoint_every_seconds: float = 180.0,
    log: Callable[[str], None] = print,
) -> training.TrainState:
    """Corpus, tokenizer, backbone (resumed when WORKDIR holds a state), export to `out`.
    Raises CorpusError when the KJV text is missing, DemoTrainingError on a state that does not match."""
    train_path, heldout_path = prepare_corpus(workdir)
    train_docs, heldout_docs = read_documents(train_path), read_documents(heldout_path)
    tokenizer = _tokenizer(workdir / "tokenizer.json", train_docs, shape.vocab_size)
    bos, eos = tokenizer.token_to_id(training.BOS_TOKEN), tokenizer.token_to_id(training.EOS_TOKEN)
    stream = training.token_stream(training.encode_documents(tokenizer, train_docs), bos, eos)
    heldout = training.token_stream(training.encode_documents(tokenizer, heldout_docs), bos, eos)
    log(
        f"corpus: {len(train_docs)} train chapters ({len(stream)} tokens), "
        f"{len(heldout_docs)} held-out chapters ({len(heldout)} tokens)"
    )

    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.hidden_size // shape.heads,
        max_position_embeddings=4 * schedule.seq_len,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_ids=(eos,),
    )
    state_path = workdir / "backbone.pt"
    if state_path.exists():
        state, saved_schedule = training.load_state(state_path)
        # The step count may change on resume (the schedule's horizon moves, e.g. to stop a run early).
        if replace(saved_schedule, steps=schedule.steps) != schedule or state.model.config != config:
            raise DemoTrainingError(
                f"{state_path} was trained with other settings ({asdict(saved_schedule)}); "
                f"delete it or use another workdir"
            )
        log(f"resuming at step {state.step}")
    elif export_only:
        raise DemoTrainingError(f"export only: no training state at {state_path}")
    else:
        state = training.new_state(config, schedule)
    params = sum(p.numel() for p in state.model.parameters())
    log(f"model: {config.num_layers} layers, d={config.hidden_size}, {params / 1e6:.2f} M parameters")
    if not export_only:
        training.train_backbone(
            state, schedule, stream, heldout, state_path, checkpoint_every_seconds=checkpoint_every_seconds, log=log
        )
    export(state.model, workdir / "tokenizer.json", out)
    return state


def prepare_corpus(workdir: Path) -> tuple[Path, Path]:
    """WORKDIR/train.txt and heldout.txt, written from the KJV on the first run."""
    train_path, heldout_path = workdir / "train.txt", workdir / "heldout.txt"
    if not (train_path.exists() and heldout_path.exists()):
        write_corpus(split_heldout(split_chapters(read_bible())), workdir)
    return train_path, heldout_path


def export(model: Transformer, tokenizer_path: Path, out: Path) -> None:
    model.attach_gates(None)
    save_checkpoint(model, tokenizer_path, out)  # BOS/EOS come from the model config


def _tokenizer(path: Path, train_docs: list[str], vocab_size: int):
    if path.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    tokenizer = training.train_tokenizer(train_docs, vocab_size)
    tokenizer.save(str(path))
    return tokenizer
