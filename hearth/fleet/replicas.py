"""Engine replicas: each one a `hearth serve` process of its own, on a free port of its machine.

A replica is an ordinary hearth server (the same command, the same code) started with a free
port, a private API key and its share of the CPU threads; the router finds it by the
"listening" line it prints. LocalReplicas runs them as child processes of the router and starts
a dead one again; RayReplicas (ray_replicas.py) runs each inside a Ray actor, which Ray places
on its cluster and restarts when it dies. Either way a replica process dies with its parent.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from collections import deque

from hearth.child_process import die_with_parent

LISTENING = re.compile(r"^listening\s+(http://\S+?)/v1\b")


class ReplicaProcess:
    """One `hearth serve` child process: `launch` starts it, `wait_ready` waits until it listens."""

    def __init__(self, serve_argv: list[str], name: str) -> None:
        self.serve_argv = serve_argv
        self.name = name
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def launch(self) -> None:
        """Start the process. Call this on a thread that lives as long as the replica should: the
        kernel's parent-death signal follows the thread that forked, not the process."""
        command = [sys.executable, "-m", "hearth.cli", "serve", *self.serve_argv]
        self.url = None
        self._ready = threading.Event()
        self._tail: deque[str] = deque(maxlen=20)
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            errors="replace", preexec_fn=die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._relay, args=(self.process, self._ready), daemon=True,
                         name=f"{self.name}-output").start()

    def _relay(self, process: subprocess.Popen, ready: threading.Event) -> None:
        """The replica's output, prefixed (which also keeps its pipe from filling up); notes its URL."""
        for line in process.stdout:
            self._tail.append(line.rstrip())
            match = LISTENING.match(line)
            if match and not ready.is_set():
                self.url = match.group(1)
                ready.set()
            sys.stderr.write(f"[{self.name}] {line}")
        ready.set()  # the process ended

    def wait_ready(self, timeout: float = 600.0) -> str:
        """Block until the launched replica listens; returns its URL or raises with its last output."""
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n" + "\n".join(self._tail))
        return self.url

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class LocalReplicas:
    """N replica processes on this machine, started together; a dead one is started again on request."""

    def __init__(self, serve_argvs: list[list[str]]) -> None:
        self.processes = [ReplicaProcess(argv, f"replica {i}") for i, argv in enumerate(serve_argvs)]

    def __len__(self) -> int:
        return len(self.processes)

    def start(self) -> list[str]:
        """Launch every replica (from this thread, which must outlive them) and wait until all listen."""
        for process in self.processes:
            process.launch()
        try:
            return [process.wait_ready() for process in self.processes]
        except RuntimeError:
            self.stop()
            raise

    def url(self, index: int) -> str | None:
        process = self.processes[index]
        return process.url if process.alive else None

    async def recover(self, index: int) -> str:
        """Start replica `index` again if its process has ended; returns its URL."""
        process = self.processes[index]
        if not process.alive:
            process.launch()  # on the event loop's thread, the main one: see launch
            await asyncio.to_thread(process.wait_ready)
        return process.url

    def kv_source(self, index: int) -> str | None:
        """Where a decode worker gets a prompt's KV from prefill worker `index`: its URL."""
        return self.url(index)

    def pid(self, index: int) -> int | None:
        process = self.processes[index].process
        return None if process is None else process.pid

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
