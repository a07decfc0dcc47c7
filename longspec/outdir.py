"""Where longspec writes: output folders it may fill, and the temporary files a kill leaves.

An output folder (``convert --out``, ``train --out``, ``draft-vocab --out``) is accepted when it
does not exist, is empty, or was written by longspec (it holds :data:`MARKER`, or a draft's
``config.json`` / a training run's ``train_config.json``). Any other folder holds a user's files:
it is refused unless ``force`` is given. A folder that is (or holds) one of the command's inputs
is refused even then. Every check runs before any slow work.

Temporary files and folders carry the writing process's id (``.NAME.tmp-PID-XXXX``), so that a
later run removes those whose process is gone (:func:`remove_stale`) without touching the ones a
live process is still writing."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

MARKER = ".longspec-output"
_TEMP = re.compile(r"^\..+\.tmp-(\d+)-")


def temp_prefix(name: str) -> str:
    """The prefix of a temporary file or folder that will become ``name``."""
    return f".{name}.tmp-{os.getpid()}-"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(folder) -> list:
    """Removes the temporary files and folders in ``folder`` left by processes that are gone
    (killed mid-write); returns their paths."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for entry in folder.iterdir():
        match = _TEMP.match(entry.name)
        if match and not _alive(int(match.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def written_by_longspec(folder: Path) -> bool:
    """Whether ``folder`` holds longspec's marker, a longspec draft or a training run."""
    if (folder / MARKER).is_file() or (folder / "train_config.json").is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("format") == "longspec-draft"
    except (OSError, ValueError, AttributeError):
        return False


def check_out_dir(out, option: str = "--out", inputs: Iterable = (), force: bool = False) -> Path:
    """Checks that ``out`` may be written (see the module docstring) and returns it. ``inputs``:
    the command's input files and folders (none may be ``out`` or lie inside it).
    Raises ValueError with a one-line message naming ``option``."""
    out = Path(out)
    real = out.resolve()
    for given in inputs:
        if given is None:
            continue
        path = Path(given).resolve()
        if real == path or real in path.parents:
            raise ValueError(f"{option} {out} would overwrite the input {given}: choose another folder")
    if out.is_symlink():  # (written whole, then swapped in: a link would be replaced by a folder, half-way)
        raise ValueError(f"{option} {out} is a symbolic link: give the folder it points to "
                         f"({os.path.realpath(out)}) or another path")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {out} is an existing file, not a folder: choose another path")
    if out.is_dir() and any(out.iterdir()) and not written_by_longspec(out) and not force:
        raise ValueError(f"{option} {out} is a folder that holds other files: choose an empty or new folder, "
                         f"or pass --force to write into it")
    return out


def mark(folder, command: str) -> None:
    """Records in ``folder`` that longspec ``command`` wrote it (later runs may replace it)."""
    Path(folder, MARKER).write_text(json.dumps({"written_by": f"longspec {command}"}) + "\n")

