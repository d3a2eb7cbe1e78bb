"""The demo model's corpus: the King James Bible from Debian's `bible-kjv` package (public domain).

`bible -f "Gen1:1-Rev22:21"` prints one verse per line, each prefixed by its reference
("Ge1:1 In the beginning ..."). We strip the references, group verses into chapters and hold out
every `HELDOUT_EVERY`-th chapter, so the held-out text samples every part of the book (the last books
alone differ in style and would make held-out perplexity say little about the model).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BIBLE_COMMAND = ("bible", "-f", "Gen1:1-Rev22:21")
HELDOUT_EVERY = 20  # chapter i is held out when i % HELDOUT_EVERY == HELDOUT_OFFSET
HELDOUT_OFFSET = 7
_VERSE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


class CorpusError(RuntimeError):
    pass


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # chapters, verses separated by newlines
    heldout: list[str]


def read_bible() -> str:
    """The whole KJV as printed by the `bible` program (Debian package bible-kjv)."""
    if shutil.which(BIBLE_COMMAND[0]) is None:
        raise CorpusError(
            "the `bible` program is missing: install the Debian package bible-kjv (apt-get install bible-kjv)"
        )
    result = subprocess.run(BIBLE_COMMAND, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise CorpusError(f"`{' '.join(BIBLE_COMMAND)}` failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


def split_chapters(bible_text: str) -> list[str]:
    chapters: list[list[str]] = []
    current: tuple[str, str] | None = None
    for line in bible_text.splitlines():
        match = _VERSE.match(line.strip())
        if match is None:
            continue  # blank or wrapped lines carry no verse
        key = (match["book"], match["chapter"])
        if key != current:
            chapters.append([])
            current = key
        chapters[-1].append(match["text"].strip())
    if not chapters:
        raise CorpusError("no verses found in the `bible` output")
    return ["\n".join(verses) for verses in chapters]


def split_heldout(chapters: list[str]) -> Corpus:
    heldout = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    train = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    return Corpus(train=train, heldout=heldout)


def write_corpus(corpus: Corpus, directory: Path) -> tuple[Path, Path]:
    """train.txt and heldout.txt, chapters separated by blank lines."""
    directory.mkdir(parents=True, exist_ok=True)
    train_path, heldout_path = directory / "train.txt", directory / "heldout.txt"
    train_path.write_text("\n\n".join(corpus.train) + "\n", encoding="utf-8")
    heldout_path.write_text("\n\n".join(corpus.heldout) + "\n", encoding="utf-8")
    return train_path, heldout_path


def read_documents(path: Path) -> list[str]:
    """A plain-text file as documents (blank-line separated). Fails clearly on unusable files."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    documents = [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    if not documents:
        raise CorpusError(f"{path}: the file holds no text")
    return documents
