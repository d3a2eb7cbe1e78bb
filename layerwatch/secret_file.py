"""Secrets read from files: the gate-frame key (layerwatch/wire.py) and the shim's mitigation
webhook token (docs/security.md). One set of rules for both, as for an SSH private key."""

from __future__ import annotations

import os
import stat

MIN_SECRET_BYTES = 32  # e.g. `openssl rand -hex 32` (64 characters)
_MAX_SECRET_FILE_BYTES = 4096


class SecretFileError(ValueError):
    """The secret file cannot be used; the message names the file and the problem."""


def read_secret_file(path: str | os.PathLike[str], what: str) -> bytes:
    """The file's bytes without surrounding whitespace. Raises SecretFileError, naming `what`
    ("frame key file") and the path.

    The file must be a regular file that only its owner can access and hold at least
    MIN_SECRET_BYTES.
    """
    try:
        # O_NONBLOCK: a FIFO (or a device) opens at once, so the check below refuses it instead of
        # the open waiting for a writer.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise SecretFileError(f"{what} {path}: not a regular file")
            if info.st_mode & 0o077:
                raise SecretFileError(
                    f"{what} {path}: group or others may access it (mode {stat.S_IMODE(info.st_mode):04o}); "
                    f"run chmod 600 {path}"
                )
            raw = file.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise SecretFileError(f"{what} {path}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_SECRET_FILE_BYTES:
        raise SecretFileError(f"{what} {path}: larger than {_MAX_SECRET_FILE_BYTES} bytes, not a secret")
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(
            f"{what} {path}: {len(secret)} bytes, at least {MIN_SECRET_BYTES} needed "
            f"(e.g. openssl rand -hex 32 > {path})"
        )
    return secret
