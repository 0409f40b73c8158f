"""BatchRunner: OpenAI's batches, run in this server's engine (each line in its model's, where the server
has several) at a lower priority than online requests.

A batch goes validating -> in_progress -> finalizing -> completed, as OpenAI reports it: failed when its
input file is malformed (with `errors`: each bad line's code, message and number), cancelling ->
cancelled when cancelled. Its lines run through the routes' own logic, in this process (chat.start,
completions.start, embeddings.embeddings), at priority BATCH_PRIORITY plus their own, so that the
scheduler admits any online request first (hearth/engine/scheduler.py). At most twice max_num_seqs lines
are in flight at once (over all batches): a seat that a line leaves is taken in the same step by the
next one waiting (or by an online request), yet the lines never flood the engine's queue. A line that answered 200
goes to the output file, any other status to the error file, both in OpenAI's line format
({"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}).

Everything lives on disk (batch_store.py): a server that starts on the directory of one killed with
SIGKILL takes every unfinished batch up where it stood, and runs only the lines that are in neither
answer file. Lines are not timed out by --request-timeout (they wait behind online requests for as long
as that takes); a server that stops (SIGTERM) leaves its unfinished lines to the next start.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from hearth.engine.async_engine import EngineStopped, QueueFull
from hearth.errors import RequestError
from hearth.server import chat, completions, embeddings
from hearth.server.batch_store import AnswerLog, BatchStore, FileStore, lock_dir, new_id
from hearth.server.errors import APIError, exception_body, validation_error
from hearth.server.protocol import ChatCompletionRequest, CompletionRequest
from hearth.server.served import Lease, ServedModel
from hearth.server.streaming import Started, final_json

logger = logging.getLogger("hearth")
BATCH_PRIORITY = 1_000_000  # added to a line's own priority: online requests (0 by default) go first
COMPLETION_WINDOW = {"24h": 24 * 3600}
QUEUE_RETRY_SECONDS = 0.05  # a line refused by a full queue (--max-queue) is tried again after this
FINISHED = ("completed", "failed", "cancelled", "expired")
MAX_LISTED_ERRORS = 100


def _generation(start: Callable[..., Awaitable[Started]]) -> Callable[..., Awaitable[dict]]:
    async def answer(body, served: ServedModel) -> dict:
        return await final_json(served, await start(body, served))

    return answer


# the endpoints a batch may name: the body's model and what answers it
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, _generation(chat.start)),
    "/v1/completions": (CompletionRequest, _generation(completions.start)),
    "/v1/embeddings": (embeddings.EmbeddingRequest, embeddings.embeddings),
}


def _line_view(served: ServedModel) -> ServedModel:
    """A batch line's view of the served model: no request timeout (lines wait behind online requests)."""
    view = copy.copy(served)
    view.limits = dataclasses.replace(served.limits, request_timeout=None)
    return view


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as OpenAI's errors count lines
    custom_id: str
    body: dict


def parse_input(data: bytes, endpoint: str) -> tuple[list[Line], list[dict]]:
    """A batch input file's lines, and OpenAI-shaped errors for those that are malformed."""
    lines, errors, seen = [], [], set()
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue

        def bad(code: str, message: str, param: str | None = None) -> None:
            errors.append({"code": code, "message": message, "param": param, "line": number})

        try:
            item = json.loads(raw)
        except ValueError:
            bad("invalid_json_line", "This line is not parseable as valid JSON.")
            continue
        if not isinstance(item, dict):
            bad("invalid_json_line", "This line is not a JSON object.")
            continue
        custom_id, body, errors_before = item.get("custom_id"), item.get("body"), len(errors)
        if not isinstance(custom_id, str) or not custom_id:
            bad("missing_required_parameter", "Missing required parameter: 'custom_id'.", "custom_id")
        elif custom_id in seen:
            bad("duplicate_custom_id", f"The custom_id {custom_id!r} is used by more than one request.", "custom_id")
        if item.get("method") != "POST":
            bad("invalid_method", "The method of every request must be POST.", "method")
        if item.get("url") != endpoint:
            bad("invalid_url", f"The url of this request does not match the batch's endpoint {endpoint}.", "url")
        if not isinstance(body, dict):
            bad("missing_required_parameter", "Missing required parameter: 'body' (a JSON object).", "body")
        if isinstance(custom_id, str):
            seen.add(custom_id)
        if len(errors) == errors_before:
            lines.append(Line(number, custom_id, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "The input file has no requests.", "param": None,
                       "line": None})
    return lines, errors[:MAX_LISTED_ERRORS]


class BatchRunner:
    def __init__(self, lease: Lease, window: int, root: Path | None) -> None:
        """lease: the served model a line's body names (served.py); at most `window` lines run at once.
        root None: a fresh temporary directory, made on first use (nothing to resume)."""
        self.lease = lease
        self.root = root
        self.opened = False
        self.files: FileStore
        self.store: BatchStore
        self.batches: dict[str, dict] = {}
        self.logs: dict[str, dict[str, AnswerLog]] = {}  # a running batch's answer files
        self.tasks: dict[str, asyncio.Task] = {}
        self.in_flight: dict[str, set[asyncio.Task]] = {}  # a running batch's lines
        self.window = asyncio.Semaphore(window)

    def open(self) -> None:
        """Take the directory (APIError 503 when another server holds it) and read what it holds."""
        if self.opened:
            return
        self.root = self.root or Path(tempfile.mkdtemp(prefix="hearth-batches-"))
        try:
            self._lock = lock_dir(self.root)
        except OSError as e:
            raise APIError(503, f"the batch directory {self.root} is in use by another server ({e.strerror}); "
                                "start this one with its own --batch-dir") from None
        self.files, self.store = FileStore(self.root), BatchStore(self.root)
        self.batches = {b["id"]: b for b in self.store.all()}
        self.opened = True

    def resume(self) -> None:
        """Take up every unfinished batch (at the server's start)."""
        self.open()
        for batch in self.batches.values():
            if batch["status"] not in FINISHED:
                logger.info("resuming %s (%s)", batch["id"], batch["status"])
                self._launch(batch)

    async def stop(self) -> None:
        """Stop running (the server stops): unfinished lines are left to the next start."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the API's operations

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        self.open()
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if completion_window not in COMPLETION_WINDOW:
            raise APIError(400, f"completion_window must be '24h', got {completion_window!r}", "completion_window")
        source = self.files.get(input_file_id)
        if source is None:
            raise APIError(404, f"No such File object: {input_file_id}", "input_file_id")
        if source["purpose"] != "batch":
            raise APIError(400, f"the file {input_file_id} has purpose {source['purpose']!r}, not 'batch'",
                           "input_file_id")
        now = int(time.time())
        batch = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + COMPLETION_WINDOW[completion_window], "finalizing_at": None,
                 "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
                 "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "metadata": metadata}
        self.store.keep_input(batch["id"], self.files.content_path(input_file_id))
        self._save(batch)
        self._launch(batch)
        return batch

    def get(self, batch_id: str) -> dict:
        self.open()
        batch = self.batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"No such Batch object: {batch_id}", "batch_id")
        logs = self.logs.get(batch_id)
        if logs is not None:  # running: the counts of the lines on disk so far
            batch["request_counts"].update(completed=logs["output"].num_written, failed=logs["errors"].num_written)
        return batch

    def all(self) -> list[dict]:
        """Every batch, newest first."""
        self.open()
        return [self.get(batch_id) for batch_id in reversed(list(self.batches))]

    def cancel(self, batch_id: str) -> dict:
        batch = self.get(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise APIError(409, f"Cannot cancel a batch with status {batch['status']!r}.")
        self._update(batch, status="cancelling", cancelling_at=int(time.time()))
        for task in self.in_flight.get(batch_id, ()):
            task.cancel()  # aborts the lines' requests in the engine; nothing of them is written
        return batch

    # ---- running a batch

    def _save(self, batch: dict) -> None:
        self.batches[batch["id"]] = batch
        self.store.save(batch)

    def _update(self, batch: dict, **fields) -> None:
        batch.update(fields)
        self._save(batch)

    def _launch(self, batch: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self.tasks[batch["id"]] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch["id"], None))

    async def _run(self, batch: dict) -> None:
        """The batch from where it stands to its end, or until the server stops."""
        try:
            if batch["status"] == "validating":
                self._validate(batch)
            if batch["status"] == "in_progress" and not await self._run_lines(batch):
                return  # lines left unanswered (the engine stopped): the next start takes them up
            if batch["status"] in ("in_progress", "finalizing", "cancelling"):
                await asyncio.to_thread(self._finalize, batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a disk error: the batch fails, the server goes on
            logger.exception("batch %s failed", batch["id"])
            self._update(batch, status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [
                {"code": "server_error", "message": f"{type(e).__name__}: {e}", "param": None, "line": None}]})

    def _lines(self, batch: dict) -> tuple[list[Line], list[dict]]:
        return parse_input(self.store.path(batch["id"], "input").read_bytes(), batch["endpoint"])

    def _validate(self, batch: dict) -> None:
        lines, errors = self._lines(batch)
        now = int(time.time())
        if errors:
            self._update(batch, status="failed", failed_at=now, errors={"object": "list", "data": errors})
        else:
            self._update(batch, status="in_progress", in_progress_at=now,
                         request_counts={"total": len(lines), "completed": 0, "failed": 0})

    async def _run_lines(self, batch: dict) -> bool:
        """Every line not answered yet, at most the window's number at once; whether all are answered
        (or the batch was cancelled)."""
        lines, _ = self._lines(batch)
        logs = self.logs[batch["id"]] = {kind: AnswerLog(self.store.path(batch["id"], kind))
                                         for kind in ("output", "errors")}
        answered = logs["output"].custom_ids | logs["errors"].custom_ids
        running = self.in_flight[batch["id"]] = set()

        def done(task: asyncio.Task) -> None:
            self.window.release()
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.error("a line of %s was not answered", batch["id"], exc_info=task.exception())

        try:
            for line in lines:
                if line.custom_id in answered:
                    continue
                await self.window.acquire()
                if batch["status"] != "in_progress":  # cancelled
                    self.window.release()
                    break
                task = asyncio.ensure_future(self._answer_line(batch["endpoint"], line, logs))
                running.add(task)
                task.add_done_callback(done)
            if running:
                await asyncio.wait(set(running))
        finally:
            for task in running:
                task.cancel()
            del self.in_flight[batch["id"]]
        answered = logs["output"].custom_ids | logs["errors"].custom_ids
        return batch["status"] != "in_progress" or all(line.custom_id in answered for line in lines)

    async def _answer_line(self, endpoint: str, line: Line, logs: dict[str, AnswerLog]) -> None:
        status, body = await self._call(endpoint, line.body)
        record = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": new_id("req_"), "body": body}, "error": None}
        await logs["output" if status == 200 else "errors"].append(record)

    async def _call(self, endpoint: str, raw: dict) -> tuple[int, dict]:
        """A line's status and response body, as the route would answer it (EngineStopped: the server stops)."""
        kind, answer = ENDPOINTS[endpoint]
        try:
            body = kind.model_validate(raw)
            if getattr(body, "stream", False):
                raise RequestError("stream is not supported in a batch")
            if hasattr(body, "priority"):
                body.priority += BATCH_PRIORITY
            while True:
                try:
                    async with self.lease(raw.get("model")) as served:
                        return 200, await answer(body, _line_view(served))
                except QueueFull:  # a full queue, or no model to unload for this one's load: wait
                    await asyncio.sleep(QUEUE_RETRY_SECONDS)
        except ValidationError as e:
            return exception_body(validation_error(e.errors()))
        except EngineStopped:
            raise
        except Exception as e:
            return exception_body(e)

    def _finalize(self, batch: dict) -> None:
        """The answer files become the batch's output and error files; then completed (or cancelled)."""
        cancelled = batch["status"] == "cancelling"
        if batch["status"] == "in_progress":
            self._update(batch, status="finalizing", finalizing_at=int(time.time()))
        for log in self.logs.pop(batch["id"], {}).values():
            log.close()
        output, errors = self._adopt(batch, "output"), self._adopt(batch, "errors")
        counts = dict(batch["request_counts"], completed=output[1], failed=errors[1])
        end = {"cancelled_at" if cancelled else "completed_at": int(time.time())}
        self._update(batch, status="cancelled" if cancelled else "completed", output_file_id=output[0],
                     error_file_id=errors[0], request_counts=counts, **end)

    def _adopt(self, batch: dict, kind: str) -> tuple[str | None, int]:
        """The stored file of the batch's answers of one kind, and their count (no file for none)."""
        file_id = f"file-{batch['id'].removeprefix('batch_')}-{kind}"
        log = self.store.path(batch["id"], kind)
        path = log if log.exists() else self.files.content_path(file_id)
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count == 0:
            log.unlink(missing_ok=True)
            return None, 0
        self.files.adopt(log, file_id, f"{batch['id']}_{kind}.jsonl", "batch_output")
        return file_id, count
