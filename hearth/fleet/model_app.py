"""One server for several models (`hearth serve --model NAME=PATH ...`, `--model-dir DIR`, `--models-preset FILE`).

The app has every route of one engine's server (hearth/server/app.py's api_app); ModelRouting sends
each request to the engine of the model its body's `model` names (a query's `model` for GET
/tokenizer_info; none: the first model), through the ModelRegistry (models.py), which loads the model
on first use and holds it while the request runs (its whole stream). This module's own routes:
/health, /version, /metrics (every loaded model's series, labelled by model_name), /v1/models (each
model with its state: loaded, unloaded, loading or sleeping, as llama.cpp's router lists them), and
vLLM's sleep mode: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping, each with `model=NAME`
where the server has several.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

from hearth.engine_config import DEFAULT_MAX_NUM_SEQS
from hearth.errors import HearthError
from hearth.fleet.models import RETRY_AFTER, ModelEntry, ModelRegistry
from hearth.fleet.presets import ModelPresets
from hearth.server import info
from hearth.server.app import api_app
from hearth.server.errors import APIError, exception_body
from hearth.server.middleware import install_middleware, replaying

# the routes that run on one model: the body's `model` (a query's, for GET) picks it
MODEL_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/embeddings", "/tokenize", "/detokenize", "/tokenizer_info", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
})


def model_paths(specs: list[str] | None, model_dir: Path | None, preset: dict[str, str] | None = None
                ) -> dict[str, str]:
    """The models to serve, by name: `--model NAME=PATH` (in order), then the `model = PATH` sections of
    --models-preset (`preset`), then each GGUF file (named without .gguf) and Hugging Face folder (with a
    config.json) in `--model-dir`, by name."""
    paths: dict[str, str] = {}

    def add(name: str, path: str) -> None:
        if name in paths:
            raise HearthError(f"two models are named {name!r}: give each its own NAME")
        paths[name] = path

    for spec in specs or []:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise HearthError(f"--model {spec!r}: expected NAME=PATH (a GGUF file, a Hugging Face folder or 'builtin')")
        add(name, path)
    for name, path in (preset or {}).items():
        add(name, path)
    if model_dir is not None:
        if not model_dir.is_dir():
            raise HearthError(f"--model-dir {model_dir}: not a directory")
        for item in sorted(model_dir.iterdir()):
            if item.is_file() and item.suffix == ".gguf":
                add(item.stem, str(item))
            elif item.is_dir() and (item / "config.json").is_file():
                add(item.name, str(item))
        if not paths:
            raise HearthError(f"--model-dir {model_dir}: no GGUF file or Hugging Face folder (with config.json) in it")
    return paths


class ModelRouting:
    """ASGI middleware (inside the body limit, which has read the body): the request's model leased from
    the registry for the request's whole life, as request.state.served; its error (404 unknown, 500
    failed load, 503 no room) in the shape of the route's API."""

    def __init__(self, app, models: ModelRegistry) -> None:
        self.app, self.models = app, models

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        body = b""
        if scope["method"] not in ("GET", "HEAD"):
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
            receive = replaying(body, receive)
        routed, name = _model_named(scope, body)
        if not routed:  # not a JSON object: the route answers it (400)
            await self.app(scope, receive, send)
            return
        lease = self.models.lease(name)
        try:
            served = await lease.__aenter__()
        except Exception as e:  # noqa: BLE001 - every failure to get the model is answered in the API's shape
            status, content = exception_body(e, scope["path"])
            headers = {"retry-after": str(RETRY_AFTER)} if status == 503 else None
            await JSONResponse(content, status_code=status, headers=headers)(scope, receive, send)
            return
        try:
            scope.setdefault("state", {})["served"] = served
            await self.app(scope, receive, send)
        finally:
            await lease.__aexit__(None, None, None)


def _model_named(scope, body: bytes) -> tuple[bool, str | None]:
    """(whether the request can be routed, the model it names: None for the default)."""
    if scope["method"] in ("GET", "HEAD"):
        return True, (parse_qs(scope["query_string"].decode("latin-1")).get("model") or [None])[0]
    try:
        data = json.loads(body)
    except ValueError:
        return False, None
    if not isinstance(data, dict):
        return False, None
    model = data.get("model")
    return True, model if isinstance(model, str) else None


class _ModelsCollector:
    """Every loaded model's metrics (each its own series, by model_name) and each model's state."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self):
        families = {}
        for entry in self.models.entries.values():
            if entry.served is None:
                continue
            for family in entry.served.metrics.registry.collect():
                if family.name.startswith("process_"):  # the process's own: once, below
                    continue
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()
        state = GaugeMetricFamily("hearth:model_loaded", "1 while a model is loaded and awake.", labels=["model_name"])
        for entry in self.models.entries.values():
            state.add_metric([entry.name], float(entry.state == "loaded"))
        yield state


router = APIRouter()
router.get("/version")(info.version)


def _models(request: Request) -> ModelRegistry:
    return request.app.state.models


@router.get("/health")
async def health(request: Request):
    """200 while every loaded model's engine runs (an unloaded or sleeping one counts as fine)."""
    engines = [e.served.engine for e in _models(request).entries.values() if e.served is not None]
    return Response(status_code=200 if all(engine.is_running for engine in engines) else 503)


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request):
    created = int(time.time())
    data = []
    for entry in _models(request).entries.values():
        status = {"value": entry.state} | ({} if entry.error is None else {"failed": True, "error": entry.error})
        length = None if entry.served is None else entry.served.max_model_len
        data.append({"id": entry.name, "object": "model", "created": created, "owned_by": "hearth", "root": entry.path,
                     "parent": None, "max_model_len": length, "status": status})
        data += [{"id": name, "object": "model", "created": created, "owned_by": "hearth", "root": path,
                  "parent": entry.name, "max_model_len": length, "status": status}
                 for name, path in entry.adapters.items()]
    return {"object": "list", "data": data}


def _entry(request: Request, model: str | None) -> ModelEntry:
    models = _models(request)
    if model is None and len(models.entries) > 1:
        raise APIError(400, "this server serves several models: name one with ?model=NAME", "model")
    return models.model(model)


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, model: str | None = None):
    await _models(request).sleep(_entry(request, model), level)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, model: str | None = None):
    await _models(request).wake_up(_entry(request, model))
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request, model: str | None = None):
    return {"is_sleeping": _entry(request, model).state == "sleeping"}


def build_models_app(models: ModelRegistry, batch_window: int, api_key: str | None = None, limits=None,
                     batch_dir: Path | None = None) -> FastAPI:
    """The app over the registry's models (limits: hearth/server/limits.py's ServerLimits)."""
    from hearth.server.limits import ServerLimits

    limits = limits or ServerLimits()
    app = api_app(models.lease, batch_window, batch_dir, lifespan_hook=models.running)
    app.state.models = models
    app.state.metrics = registry = CollectorRegistry(auto_describe=True)
    registry.register(_ModelsCollector(models))
    ProcessCollector(registry=registry)
    app.include_router(router)
    app.add_middleware(ModelRouting, models=models)  # first added: innermost, after the body is read
    install_middleware(app, limits, api_key)
    return app


def model_args(args: argparse.Namespace, path: str, own: dict[str, Any]) -> argparse.Namespace:
    """A model's arguments: the serve command's, its own engine flags from --models-preset over them."""
    return argparse.Namespace(**{**vars(args), **own, "model": path})


def model_builder(args: argparse.Namespace, limits, presets: dict[str, dict] | None = None):
    """The registry's Build: a model's engine from the serve command's engine flags, as `hearth serve
    PATH` would build it, with its own from --models-preset (`presets`, by model) and its LoRA adapters."""
    def build(name: str, path: str, adapters: dict[str, str]):
        from hearth.engine.async_engine import AsyncEngine, build_on_passing_thread
        from hearth.engine_args import build_llm
        from hearth.server.served import ServedModel

        loras = tuple(f"{n}={p}" for n, p in adapters.items())
        engine = build_on_passing_thread(  # (its OpenMP team let go: serve.py)
            lambda: build_llm(model_args(args, path, (presets or {}).get(name, {})), lora_modules=loras).engine)
        async_engine = AsyncEngine(engine, max_queue=args.max_queue, step_timeout=args.step_timeout)
        return ServedModel(async_engine, [name], limits, args.tool_call_parser, args.trust_request_chat_template,
                           tuple(args.allowed_media_domains or ()))

    return build


def models_from_args(args: argparse.Namespace, limits, **keywords) -> ModelRegistry:
    """The registry of `hearth serve`'s --model / --model-dir / --models-preset models, --lora's adapters the
    first model's (and each model's own `lora` in the preset file); keywords: the registry's own (slot_wait)."""
    from hearth.engine_config import LoRAConfig

    presets = ModelPresets(args.models_preset)
    paths = model_paths(args.models, args.model_dir, presets.model_paths())
    own = presets.check(list(paths))
    preset_loras = {name: tuple(values.pop("lora_modules", ())) for name, values in own.items()}  # (adapters)
    if getattr(args, "mmproj", None) is not None and len(paths) > 1:
        raise HearthError("--mmproj is one text model's vision projector: not for several models at once")
    try:
        adapters = dict(LoRAConfig(lora_modules=tuple(args.lora_modules or ())).named_paths())
        models = ModelRegistry(paths, model_builder(args, limits, own), args.max_loaded_models,
                               args.sleep_idle_seconds, default_adapters=adapters, **keywords)
        for name, loras in preset_loras.items():
            models.entries[name].adapters.update(LoRAConfig(lora_modules=loras).named_paths())
        return models
    except ValueError as e:
        raise HearthError(str(e)) from None


def run_models_server(args: argparse.Namespace) -> None:
    """`hearth serve --model NAME=PATH ... | --model-dir DIR`: serve the models until SIGTERM."""
    from hearth.server.batch_store import default_batch_dir
    from hearth.server.limits import ServerLimits
    from hearth.server.serve import run_uvicorn

    try:
        limits = ServerLimits.from_args(args)
    except ValueError as e:
        raise HearthError(str(e)) from None
    models = models_from_args(args, limits)
    batch_dir = args.batch_dir or default_batch_dir()
    # (the batch window, before any model is loaded: the default where no count is given)
    app = build_models_app(models, args.max_num_seqs or DEFAULT_MAX_NUM_SEQS, args.api_key, limits, batch_dir)
    for entry in models.entries.values():
        print(f"model      {entry.name}: {entry.path}")
    limit = f"at most {args.max_loaded_models} at once" if args.max_loaded_models else "no limit to how many at once"
    print(f"loaded     on first use; {limit}"
          + (f"; asleep after {args.sleep_idle_seconds:g} s idle" if args.sleep_idle_seconds else ""))
    print(f"batches    {batch_dir}", flush=True)
    run_uvicorn(app, args, limits, on_stop=models.shutdown)
