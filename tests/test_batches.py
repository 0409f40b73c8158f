"""The Files and Batch APIs (hearth/server/files.py, batches.py, batch_runner.py), through the openai SDK
against `hearth serve builtin` as a child process: end to end, a malformed input file, a cancel, and a
server killed with SIGKILL in the middle of a batch and started again on the same --batch-dir.

Each batch line's answer is checked against the same request sent directly at temperature 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

from hearth.default_model import builtin_model_path
from hearth.server.batch_store import AnswerLog, lock_dir

pytestmark = pytest.mark.skipif(not builtin_model_path().exists(), reason="the built-in model is not built")
REPO = Path(__file__).resolve().parents[1]
MODEL = "builtin"
FINISHED = ("completed", "failed", "cancelled")


@contextlib.contextmanager
def hearth_serve(batch_dir: Path, *options: str):
    """`hearth serve builtin --batch-dir DIR OPTIONS` as a child process; yields (its URL, the process)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli", "serve", "builtin", "--served-model-name", MODEL, "--port", "0",
         "--batch-dir", str(batch_dir), "--no-access-log", "--kv-cache-memory", "8MiB", *options],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        url = next((line.split()[1] for line in proc.stdout if line.startswith("listening")), None)
        if url is None:
            proc.wait(timeout=60)
            stderr.seek(0)
            raise AssertionError(f"the server did not start (exit {proc.returncode}):\n{stderr.read()[-3000:]}")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stderr.close()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with hearth_serve(tmp_path_factory.mktemp("batches")) as (url, _):
        yield sdk(url)


def jsonl(lines: list[dict]) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def request_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_batch(client: openai.OpenAI, lines: list[dict], endpoint: str, timeout: float = 120):
    """Upload the lines, run them as a batch, wait for its end; the batch and the statuses seen."""
    uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    seen = [batch.status]
    deadline = time.monotonic() + timeout
    while batch.status not in FINISHED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
        seen += [batch.status] if batch.status != seen[-1] else []
    return batch, seen


def answers(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    """A batch output or error file's lines by custom_id (each custom_id once)."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert set(line["response"]) == {"status_code", "request_id", "body"}
    return by_id


def test_files_and_batches_end_to_end_with_the_openai_sdk(client):
    chats = [{"model": MODEL, "messages": [{"role": "user", "content": f"def f{i}("}], "max_tokens": 8,
              "temperature": 0} for i in range(4)]
    lines = [request_line(f"chat-{i}", "/v1/chat/completions", body) for i, body in enumerate(chats)]
    lines.append(request_line("bad", "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}))
    lines.append(request_line("unknown", "/v1/chat/completions", {**chats[0], "model": "nobody"}))
    batch, seen = run_batch(client, lines, "/v1/chat/completions")
    assert batch.status == "completed" and seen[-1] == "completed" and seen[0] == "validating"
    assert [s for s in seen if s in ("validating", "in_progress", "finalizing", "completed")] == seen
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 4, 2)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.expires_at
    output, errors = answers(client, batch.output_file_id), answers(client, batch.error_file_id)
    assert sorted(output) == [f"chat-{i}" for i in range(4)] and sorted(errors) == ["bad", "unknown"]
    for i, body in enumerate(chats):  # the same answer as the request sent directly
        direct = client.chat.completions.create(**body)
        line = output[f"chat-{i}"]["response"]
        assert line["status_code"] == 200 and line["body"]["object"] == "chat.completion"
        assert line["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert line["body"]["usage"] == direct.usage.model_dump(exclude_none=True)
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"] == "messages"
    assert errors["unknown"]["response"]["status_code"] == 404

    listed = {f.id: f for f in client.files.list()}
    assert listed[batch.output_file_id].purpose == "batch_output" and listed[batch.input_file_id].purpose == "batch"
    assert client.files.retrieve(batch.input_file_id).bytes == len(jsonl(lines))
    assert client.files.content(batch.input_file_id).content == jsonl(lines)
    assert client.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.input_file_id)
    assert client.batches.retrieve(batch.id).status == "completed"  # its input was kept with it


def test_embeddings_and_completions_batches_and_the_batch_list(client):
    inputs = ["def add(a, b):", "import os"]
    lines = [request_line(f"e{i}", "/v1/embeddings", {"model": MODEL, "input": text}) for i, text in enumerate(inputs)]
    batch, _ = run_batch(client, lines, "/v1/embeddings")
    output = answers(client, batch.output_file_id)
    for i, text in enumerate(inputs):
        direct = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        np.testing.assert_allclose(output[f"e{i}"]["response"]["body"]["data"][0]["embedding"], direct, rtol=1e-5)
    body = {"model": MODEL, "prompt": "class Stack:", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    second, _ = run_batch(client, [request_line("c", "/v1/completions", body)], "/v1/completions")
    completion = answers(client, second.output_file_id)["c"]["response"]["body"]
    direct = client.completions.create(**body)
    assert completion["choices"][0]["text"] == direct.choices[0].text
    assert completion["choices"][0]["logprobs"]["tokens"] == direct.choices[0].logprobs.tokens

    newest = client.batches.list(limit=1)
    assert [b.id for b in newest.data] == [second.id] and newest.has_more
    assert client.batches.list(limit=1, after=second.id).data[0].id == batch.id
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/moderations",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):  # an output file is no input
        client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-none", endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def test_a_malformed_input_file_fails_with_its_errors(client):
    good = request_line("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    lines = [json.dumps(good), "{not json", json.dumps({**good, "custom_id": None}), json.dumps(good),
             json.dumps({**good, "custom_id": "b", "url": "/v1/embeddings"})]
    uploaded = client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    while batch.status not in FINISHED:
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    found = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert found == [(2, "invalid_json_line", None), (3, "missing_required_parameter", "custom_id"),
                     (4, "duplicate_custom_id", "custom_id"), (5, "invalid_url", "url")]


def test_cancel_stops_a_running_batch(client):
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    lines = [request_line(f"r{i}", "/v1/completions", body) for i in range(40)]
    uploaded = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    while batch.status == "validating":
        batch = client.batches.retrieve(batch.id)
    batch = client.batches.cancel(batch.id)
    assert batch.status == "cancelling" and batch.cancelling_at
    while batch.status == "cancelling":
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.completed_at is None
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed < 40 and counts.failed == 0
    assert len(answers(client, batch.output_file_id)) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"


def wait_for(client: openai.OpenAI, batch_id: str, done: int, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINISHED or batch.request_counts.completed >= done:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)


@pytest.mark.slow
def test_a_batch_killed_with_sigkill_resumes_and_answers_every_line_once(tmp_path):
    prompts = [f"def function_{i}(x):\n    return" for i in range(40)]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0} for p in prompts]
    lines = [request_line(f"line-{i}", "/v1/completions", body) for i, body in enumerate(bodies)]
    with hearth_serve(tmp_path, "--max-num-seqs", "2") as (url, proc):
        client = sdk(url)
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        partial = wait_for(client, batch.id, done=6)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert partial.status == "in_progress" and partial.request_counts.completed < 40
    with hearth_serve(tmp_path) as (url, _):
        client = sdk(url)
        batch = wait_for(client, batch.id, done=40)
        while batch.status not in FINISHED:
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 40
        output = answers(client, batch.output_file_id)  # every custom_id once
        assert sorted(output) == sorted(line["custom_id"] for line in lines)
        with ThreadPoolExecutor(8) as pool:
            direct = list(pool.map(lambda body: client.completions.create(**body).choices[0].text, bodies))
    assert [output[f"line-{i}"]["response"]["body"]["choices"][0]["text"] for i in range(40)] == direct


def test_an_answer_file_torn_by_a_crash_loses_only_its_unfinished_line(tmp_path):
    path = tmp_path / "batch_x.output.jsonl"
    whole = b'{"custom_id": "a", "response": {}}\n{"custom_id": "b", "response": {}}\n'
    path.write_bytes(whole + b'{"custom_id": "c", "resp')  # killed in the middle of writing "c"
    log = AnswerLog(path)
    assert log.custom_ids == {"a", "b"} and log.num_written == 2 and path.read_bytes() == whole

    async def append_two() -> None:
        await asyncio.gather(log.append({"custom_id": "c"}), log.append({"custom_id": "d"}))

    asyncio.run(append_two())
    log.close()
    assert [json.loads(line)["custom_id"] for line in path.read_bytes().splitlines()] == ["a", "b", "c", "d"]
    assert AnswerLog(path).num_written == 4


def test_one_server_at_a_time_holds_a_batch_directory(tmp_path):
    held = lock_dir(tmp_path)
    with pytest.raises(OSError):
        lock_dir(tmp_path)  # what a second server meets: it answers the batch APIs with a 503
    held.close()
    lock_dir(tmp_path).close()
