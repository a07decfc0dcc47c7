"""Reading a user's text files safely: regular files only (not a FIFO, which would block, nor a
device such as ``/dev/zero`` behind a link, which never ends), never more than a cap, UTF-8."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def read_text(path, max_bytes: int, what: str = "file") -> str:
    """The UTF-8 text of ``path``, read only if it is a regular file (links followed) of at most
    ``max_bytes`` bytes; at most ``max_bytes + 1`` bytes are ever read (a file's size can change
    while it is read). Raises ValueError saying why not (``what`` names the file in it)."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ValueError(f"{what} {path} not found") from None
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a pipe, socket or device)")
    if info.st_size > max_bytes:
        raise ValueError(f"{what} {path} has {info.st_size} bytes, more than the {max_bytes} read at most")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # (a FIFO swapped in: no wait)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{what} {path} is not a regular file (a pipe, socket or device)")
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{what} {path} has more than the {max_bytes} bytes read at most")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}): give a text file") from None
