"""The Files and Batch APIs' state on disk, under one directory (`hearth serve --batch-dir DIR`):
what a server killed with SIGKILL finds again when it starts on the same directory.

    DIR/lock                        held (flock) by the one server that uses DIR
    DIR/files/ID.json, ID.data      a file's object (OpenAI's FileObject) and its content
    DIR/batches/ID.json             a batch's object, replaced whole at each change of status
    DIR/batches/ID.input.jsonl      the input file's lines as they were when the batch was created
    DIR/batches/ID.output.jsonl     the lines answered so far (and ID.errors.jsonl those that failed)

Every object is written to a temporary name, fsynced and renamed over the old one, so a reader finds
the old object or the new one, never half of one. A content is complete before the object that
names it. An answered line is appended to its file and fsynced before it counts as done (AnswerLog):
after a crash the files hold each answered line once, the last perhaps torn (cut off on restart), and
a line found in neither file is run again.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import TextIO


def default_batch_dir() -> Path:
    """`hearth serve`'s --batch-dir when none is given: under the user's cache directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hearth" / "batches"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` whole: a crash leaves the old content or the new one."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def write_json(path: Path, value: dict) -> None:
    write_atomic(path, json.dumps(value, ensure_ascii=False).encode())


def lock_dir(root: Path) -> TextIO:
    """Take DIR/lock for this process (the open file: keep it); OSError when another server holds it."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / "lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise
    return handle


class FileStore:
    """DIR/files: uploaded files and the batches' output and error files."""

    def __init__(self, root: Path) -> None:
        self.folder = root / "files"
        self.folder.mkdir(parents=True, exist_ok=True)

    def content_path(self, file_id: str) -> Path:
        return self.folder / f"{file_id}.data"

    def _object_path(self, file_id: str) -> Path:
        return self.folder / f"{file_id}.json"

    def create(self, content: bytes, filename: str, purpose: str) -> dict:
        file_id = new_id("file-")
        write_atomic(self.content_path(file_id), content)
        return self._register(file_id, len(content), filename, purpose)

    def adopt(self, source: Path, file_id: str, filename: str, purpose: str) -> dict:
        """Make the file at `source` a stored file under `file_id` (moved; again after a crash: no-op)."""
        if source.exists():
            os.replace(source, self.content_path(file_id))
            _fsync_dir(self.folder)
        return self.get(file_id) or self._register(file_id, self.content_path(file_id).stat().st_size, filename,
                                                   purpose)

    def _register(self, file_id: str, size: int, filename: str, purpose: str) -> dict:
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
               "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None}
        write_json(self._object_path(file_id), obj)
        return obj

    def get(self, file_id: str) -> dict | None:
        if "/" in file_id or file_id.startswith("."):
            return None
        try:
            return json.loads(self._object_path(file_id).read_text())
        except (OSError, ValueError):
            return None

    def all(self) -> list[dict]:
        """Every file, oldest first."""
        files = (self.get(p.stem) for p in self.folder.glob("*.json"))
        return sorted((f for f in files if f is not None), key=lambda f: (f["created_at"], f["id"]))

    def delete(self, file_id: str) -> bool:
        if self.get(file_id) is None:
            return False
        self._object_path(file_id).unlink()
        self.content_path(file_id).unlink(missing_ok=True)
        return True


class BatchStore:
    """DIR/batches: each batch's object, its input lines and its answers so far."""

    def __init__(self, root: Path) -> None:
        self.folder = root / "batches"
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, batch_id: str, part: str) -> Path:
        """part: "json" (the object), "input", "output" or "errors" (JSONL files)."""
        return self.folder / (f"{batch_id}.json" if part == "json" else f"{batch_id}.{part}.jsonl")

    def save(self, batch: dict) -> None:
        write_json(self.path(batch["id"], "json"), batch)

    def keep_input(self, batch_id: str, source: Path) -> None:
        target = self.path(batch_id, "input")
        shutil.copyfile(source, target)
        with open(target, "rb") as f:
            os.fsync(f.fileno())

    def all(self) -> list[dict]:
        """Every batch, oldest first."""
        batches = []
        for p in self.folder.glob("*.json"):
            try:
                batches.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(batches, key=lambda b: (b["created_at"], b["id"]))


class AnswerLog:
    """One of a batch's answer files: lines appended and fsynced before they count. Lines that finish
    while a write is under way go out together in the next one (one fsync for all of them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.custom_ids = self._recover()  # the lines answered: on disk, or on their way there
        self.num_written = len(self.custom_ids)  # the lines on disk (fsynced)
        self._file = open(path, "ab")
        self._lock = asyncio.Lock()
        self._pending: list[bytes] = []
        self._queued = self.num_written
        self._writing = threading.Lock()  # a write cancelled in its caller still runs to its end, alone

    def _recover(self) -> set[str]:
        """The custom_ids already answered; a last line torn by a crash is cut off."""
        if not self.path.exists():
            return set()
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
                os.fsync(f.fileno())
        return {json.loads(line)["custom_id"] for line in whole.splitlines() if line.strip()}

    async def append(self, record: dict) -> None:
        """Write `record` as a line; returns once it is on disk (if cancelled before, it goes with the
        next write, or at close)."""
        self.custom_ids.add(record["custom_id"])
        self._pending.append((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self._queued += 1
        mine = self._queued
        async with self._lock:
            if self.num_written >= mine:  # an earlier writer took it along
                return
            lines, self._pending = self._pending, []
            await asyncio.to_thread(self._write, lines)

    def _write(self, lines: list[bytes]) -> None:
        with self._writing:
            self._file.write(b"".join(lines))
            self._file.flush()
            os.fsync(self._file.fileno())
            self.num_written += len(lines)

    def close(self) -> None:
        """Write what is pending, and close the file."""
        lines, self._pending = self._pending, []
        self._write(lines)
        with self._writing:
            self._file.close()
