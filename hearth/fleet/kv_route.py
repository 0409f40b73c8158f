"""A prefill worker's KV route as its callers see it (disaggregated.py serves it): its path, how a
worker reached through its Ray actor is named, the key sent, the answer read. Torch-free, so that
the Ray actors that call the route (ray_replicas.py), which only start and ask their replica, do
not import torch: an actor that Ray starts again is that much sooner back."""

from __future__ import annotations

KV_PATH = "/kv/prefill"
RAY_SCHEME = "ray://"  # a prefill worker named by its Ray actor: ray://GCS_ADDRESS/NAMESPACE/ACTOR


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def check_kv_answer(status: int, body: bytes) -> bytes:
    """A prefill worker's answer to POST /kv/prefill: the body when it is the KV; raises otherwise."""
    if status != 200:
        raise RuntimeError(f"status {status}: {body[:200]!r}")
    return body
