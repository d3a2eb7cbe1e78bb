"""`layerwatch train-demo`: build the embedded demo model from scratch.

1. corpus: the KJV from the `bible` program (Debian bible-kjv), every 20th chapter held out;
2. tokenizer: byte-level BPE with `tokenizers`;
3. backbone: a Llama-architecture model trained with layer dropout rising with depth, resumable
   (state in WORKDIR/backbone.pt, rerun the same command to continue after an interruption);
4. export: the Hugging Face folder (config.json, model.safetensors, tokenizer files) in --out.

Gates are trained afterwards by `layerwatch train-gates` (see docs/gate-training.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

from inference_shim.offline.corpus import CorpusError, read_bible, read_documents, split_chapters, split_heldout, write_corpus

DEFAULT_WORKDIR = Path("runs/demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from inference_shim.runtime.demo_model import DEMO_MODEL_DIR

    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                        help="corpus, tokenizer and resumable training state (default: runs/demo)")
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR, help="the exported model folder")
    parser.add_argument("--steps", type=int, default=2500,
                        help="optimiser steps (may change when resuming: the schedule's horizon moves)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--max-layer-drop", type=float, default=0.5,
                        help="layer dropout of the deepest unprotected layer; rises linearly with depth")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default; on a busy shared CPU 1 is often fastest)")
    parser.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds between state saves")
    parser.add_argument("--export-only", action="store_true",
                        help="export the saved training state as it is (e.g. to stop a run early)")


def run(args: argparse.Namespace) -> int:
    import torch

    from inference_shim.offline import training
    from inference_shim.runtime.model import ModelConfig

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    workdir: Path = args.workdir
    try:
        train_path, heldout_path = _prepare_corpus(workdir)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_docs, heldout_docs = read_documents(train_path), read_documents(heldout_path)

    tokenizer_path = workdir / "tokenizer.json"
    if tokenizer_path.exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        tokenizer = training.train_tokenizer(train_docs, args.vocab_size)
        tokenizer.save(str(tokenizer_path))
    bos, eos = tokenizer.token_to_id(training.BOS_TOKEN), tokenizer.token_to_id(training.EOS_TOKEN)
    stream = training.token_stream(training.encode_documents(tokenizer, train_docs), bos, eos)
    heldout = training.token_stream(training.encode_documents(tokenizer, heldout_docs), bos, eos)
    print(f"corpus: {len(train_docs)} train chapters ({len(stream)} tokens), "
          f"{len(heldout_docs)} held-out chapters ({len(heldout)} tokens)", flush=True)

    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.hidden_size // args.heads,
        max_position_embeddings=4 * args.seq_len, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_ids=(eos,))
    schedule = training.BackboneSchedule(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.learning_rate,
        max_layer_drop=args.max_layer_drop, seed=args.seed)

    state_path = workdir / "backbone.pt"
    if state_path.exists():
        state, saved_schedule = training.load_state(state_path)
        # --steps may change on resume (the schedule's horizon moves, e.g. to stop a run early).
        if replace(saved_schedule, steps=schedule.steps) != schedule or state.model.config != config:
            print(f"error: {state_path} was trained with other settings "
                  f"({asdict(saved_schedule)}); delete it or use another --workdir", file=sys.stderr)
            return 2
        print(f"resuming at step {state.step}", flush=True)
    elif args.export_only:
        print(f"error: --export-only: no training state at {state_path}", file=sys.stderr)
        return 2
    else:
        state = training.new_state(config, schedule)
    params = sum(p.numel() for p in state.model.parameters())
    print(f"model: {config.num_layers} layers, d={config.hidden_size}, {params / 1e6:.2f} M parameters", flush=True)
    if not args.export_only:
        training.train_backbone(state, schedule, stream, heldout, state_path,
                                checkpoint_every_seconds=args.checkpoint_every,
                                log=lambda line: print(line, flush=True))
    _export(state.model, workdir, args.out)
    print(f"exported to {args.out} after {state.step} steps, {state.elapsed_seconds / 60:.1f} min of training")
    return 0


def _prepare_corpus(workdir: Path) -> tuple[Path, Path]:
    train_path, heldout_path = workdir / "train.txt", workdir / "heldout.txt"
    if not (train_path.exists() and heldout_path.exists()):
        write_corpus(split_heldout(split_chapters(read_bible())), workdir)
    return train_path, heldout_path


def _export(model, workdir: Path, out: Path) -> None:
    from inference_shim.runtime.checkpoint import save_checkpoint

    model.attach_gates(None)
    save_checkpoint(model, workdir / "tokenizer.json", out)  # BOS/EOS come from the model config
