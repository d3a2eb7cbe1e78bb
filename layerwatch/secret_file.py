"""Secrets read from files: the gate-frame key (layerwatch/wire.py) and the shim's mitigation
webhook token (docs/security.md). One set of rules for both, as for an SSH private key."""

from __future__ import annotations

import logging
import os
import stat
import threading

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 32  # e.g. `openssl rand -hex 32` (64 characters)
_MAX_SECRET_FILE_BYTES = 4096


class SecretFileError(ValueError):
    """The secret file cannot be used; the message names the file and the problem."""


def read_secret_file(path: str | os.PathLike[str], what: str, *, header_value: bool = False) -> bytes:
    """The file's bytes without surrounding whitespace. Raises SecretFileError, naming `what`
    ("frame key file") and the path.

    The file must be a regular file that only its owner can access and hold at least
    MIN_SECRET_BYTES. A `header_value` (a bearer token) must also be printable ASCII, what an HTTP
    header carries as it is: a token of other bytes was accepted and could never match, so every
    request got 401.
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
    content = raw.strip()
    if len(content) < MIN_SECRET_BYTES:
        raise SecretFileError(
            f"{what} {path}: {len(content)} bytes, at least {MIN_SECRET_BYTES} needed "
            f"(e.g. openssl rand -hex 32 > {path})"
        )
    if header_value:
        for offset, byte in enumerate(content):
            if not 0x20 <= byte <= 0x7E:
                raise SecretFileError(
                    f"{what} {path}: byte {offset} (0x{byte:02x}) is not printable ASCII, which an HTTP header "
                    f"cannot carry as it is (e.g. openssl rand -hex 32 > {path})"
                )
    return content


class RotatingSecret:
    """A secret file read again when it changes, so that it can be rotated without a restart (as
    Alertmanager reads its credentials_file at each notification). The first read raises
    SecretFileError; a later replacement that breaks the rules is logged and the last good secret
    stays in use."""

    def __init__(self, path: str | os.PathLike[str], what: str, *, header_value: bool = False) -> None:
        self._path = path
        self._what = what
        self._header_value = header_value
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._value = read_secret_file(path, what, header_value=header_value)

    def current(self) -> bytes:
        with self._lock:
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._value = read_secret_file(self._path, self._what, header_value=self._header_value)
                    log.warning("%s %s changed: its new secret is in use", self._what, self._path)
                except SecretFileError as exc:
                    log.error("%s; the secret read before stays in use", exc)
            return self._value

    def _stat(self) -> tuple[int, ...] | None:
        """What tells a changed file: a new inode (a rename over it), mtime, size or mode."""
        try:
            info = os.stat(self._path)
        except OSError:
            return None
        return (info.st_ino, info.st_mtime_ns, info.st_size, info.st_mode)
