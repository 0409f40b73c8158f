"""Several models in one server (`hearth serve --model NAME=PATH ...`), as OpenAI's client sees it.

The server holds the built-in model ("tiny"), SmolLM2's Q4_1 GGUF from ../shared ("smol": those parts
skip when it is absent), and a file that is no model ("bad"), at most one loaded at a time. Each reply
is compared with that model's own offline greedy output (LLM.generate).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path

import httpx
import openai
import pytest

from hearth import LLM, SamplingParams
from hearth.cli import build_parser, main
from hearth.engine.async_engine import QueueFull
from hearth.errors import HearthError
from hearth.engine_args import engine_options
from hearth.engine_config import EngineConfig
from hearth.fleet.model_app import build_models_app, model_args, model_paths, models_from_args
from hearth.fleet.presets import ModelPresets
from hearth.fleet.models import ModelRegistry
from hearth.server.limits import ServerLimits
from test_server import serving

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(not GGUF.exists(), reason=f"reference data not found: {DATA}")
PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags, "--max-num-seqs", "8", "--no-access-log"])


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "bad.gguf"
    path.write_bytes(b"GGUF this is no model")
    return path


@pytest.fixture(scope="module")
def server(bad_file):
    """(base URL, the registry, how many loads each model has had)."""
    specs = ["--model", "tiny=builtin", "--model", f"smol={GGUF}", "--model", f"bad={bad_file}"]
    args = serve_args(*specs, "--max-loaded-models", "1")
    limits = ServerLimits()
    models, loads = models_from_args(args, limits, slot_wait=0.3), {}
    build = models.build

    def counted(name, path, adapters):
        loads[name] = loads.get(name, 0) + 1
        return build(name, path, adapters)

    models.build = counted
    with serving(build_models_app(models, 16, limits=limits)) as url:
        yield url, models, loads


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """Each model's own greedy continuation of PROMPT."""
    paths = {"tiny": "builtin"} | ({"smol": str(GGUF)} if GGUF.exists() else {})
    return {name: LLM(path, progress=False).generate([PROMPT], GREEDY)[0].outputs[0].text for name, path in paths.items()}


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_model_paths_from_flags_and_a_folder(tmp_path, bad_file):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    args = serve_args("--model", "x=builtin", "--model-dir", str(tmp_path))
    assert model_paths(args.models, args.model_dir) == {"x": "builtin", "a": str(tmp_path / "a.gguf"),
                                                         "hf": str(tmp_path / "hf")}
    with pytest.raises(HearthError, match="two models are named 'x'"):
        model_paths(["x=builtin", "x=other"], None)
    with pytest.raises(HearthError, match="NAME=PATH"):
        model_paths(["builtin"], None)


def test_routing_load_on_first_use_and_lru_unload(server, client, expected):
    url, _, loads = server
    assert states(url) == {"tiny": "unloaded", "smol": "unloaded", "bad": "unloaded"}
    assert complete(client, "tiny") == expected["tiny"]
    assert states(url)["tiny"] == "loaded"
    if GGUF.exists():  # only one at a time: smol's load unloads tiny, and tiny's next request loads it again
        assert complete(client, "smol") == expected["smol"] != expected["tiny"]
        assert states(url) == {"tiny": "unloaded", "smol": "loaded", "bad": "unloaded"}
        assert complete(client, "tiny") == expected["tiny"]
        assert states(url)["smol"] == "unloaded" and loads["tiny"] == 2
    # each loaded model's metrics carry its name
    metrics = httpx.get(url + "/metrics").text
    assert 'hearth:prompt_tokens_total{model_name="tiny"}' in metrics
    assert 'hearth:model_loaded{model_name="tiny"} 1.0' in metrics


def test_unknown_model_is_a_404_in_each_apis_shape(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    r = httpx.post(server[0] + "/v1/messages", json={"model": "no-such-model", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"


def test_a_model_that_fails_to_load_says_why_and_the_others_serve(server, client, expected):
    url = server[0]
    with pytest.raises(openai.InternalServerError) as e:
        complete(client, "bad")
    assert "`bad`" in e.value.message and "bad.gguf" in e.value.message
    bad = next(m for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] == "bad")
    assert bad["status"]["failed"] and bad["status"]["value"] == "unloaded"
    assert complete(client, "tiny") == expected["tiny"]
    assert httpx.get(url + "/health").status_code == 200


def test_concurrent_first_requests_load_once(server, client, expected):
    url, _, loads = server
    for name, state in states(url).items():  # nothing loaded (level 2 sleep unloads)
        if state == "loaded":
            assert httpx.post(url + "/sleep", params={"model": name, "level": 2}).status_code == 200
    before = loads.get("tiny", 0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: complete(client, "tiny"), range(4)))
    assert texts == [expected["tiny"]] * 4 and loads["tiny"] == before + 1


def test_sleep_and_wake_keep_greedy_output(server, client, expected):
    url, models, loads = server
    assert complete(client, "tiny") == expected["tiny"]
    runner = models.entries["tiny"].served.engine.engine.runner
    assert httpx.post(url + "/sleep", params={"model": "tiny", "level": 1}).status_code == 200
    assert httpx.get(url + "/is_sleeping", params={"model": "tiny"}).json() == {"is_sleeping": True}
    assert states(url)["tiny"] == "sleeping"
    assert all(not t.any() for t, _ in runner._cache_tensors())  # its pages given back: they read as zeros
    assert httpx.post(url + "/wake_up", params={"model": "tiny"}).status_code == 200
    assert httpx.get(url + "/is_sleeping", params={"model": "tiny"}).json() == {"is_sleeping": False}
    assert complete(client, "tiny") == expected["tiny"]
    # level 2: the weights go too; a request wakes it (a load)
    before = loads["tiny"]
    assert httpx.post(url + "/sleep", params={"model": "tiny", "level": 2}).status_code == 200
    assert states(url)["tiny"] == "sleeping" and models.entries["tiny"].served is None
    assert complete(client, "tiny") == expected["tiny"] and loads["tiny"] == before + 1
    # several models: the sleep endpoints need the name
    r = httpx.post(url + "/sleep", params={"level": 1})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    assert httpx.post(url + "/sleep", params={"model": "tiny", "level": 3}).status_code == 400


@needs_smollm2
def test_a_model_in_use_is_not_unloaded(server, client, expected):
    """With one model loaded and a request in flight on it, another model's load is refused (503,
    Retry-After) after the registry's wait; once the request ends, the load goes through."""
    url = server[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)  # tiny is running
            r = http.post("/v1/completions", json={"model": "smol", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] and "--max-loaded-models" in r.text
        # the stream closed: its request is aborted and tiny can go
    assert complete(client, "smol") == expected["smol"]


def test_batch_lines_go_to_the_model_they_name(server, client, expected):
    from test_batches import answers, request_line, run_batch

    lines = [request_line(name, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 8,
                                                    "temperature": 0}) for name in expected]
    lines.append(request_line("unknown", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}))
    batch, _ = run_batch(client, lines, "/v1/completions")
    output, errors = answers(client, batch.output_file_id), answers(client, batch.error_file_id)
    assert {name: line["response"]["body"]["choices"][0]["text"] for name, line in output.items()} == expected
    assert errors["unknown"]["response"]["status_code"] == 404
    assert errors["unknown"]["response"]["body"]["error"]["code"] == "model_not_found"


def test_idle_models_sleep_and_wake_on_request(expected):
    """--sleep-idle-seconds: an idle model sleeps (level 1); its next request wakes it, same greedy output.
    One model: the sleep endpoints need no name."""
    args = serve_args("--model", "tiny=builtin", "--sleep-idle-seconds", "0.3")
    with serving(build_models_app(models_from_args(args, ServerLimits()), 16)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert complete(client, "tiny") == expected["tiny"]
        deadline = time.monotonic() + 10
        while not httpx.get(url + "/is_sleeping").json()["is_sleeping"]:
            assert time.monotonic() < deadline, "the idle model did not go to sleep"
            time.sleep(0.1)
        unnamed = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert unnamed.json()["choices"][0]["text"] == expected["tiny"]  # no model named: the first
        assert states(url)["tiny"] == "loaded"


@pytest.mark.parametrize("argv, message", [
    (["serve", "builtin", "--model", "x=builtin"], "not both"),
    (["serve", "--model", "x=builtin", "--data-parallel-size", "2"], "one process"),
    (["serve", "--model-dir", "/nonexistent"], "not a directory"),
    (["serve", "--model", "x=builtin", "--max-loaded-models", "0"], "at least 1"),
])
def test_bad_model_flags_are_refused(argv, message, capsys):
    assert main(argv) == 1 and message in capsys.readouterr().err


def test_registry_refuses_a_load_while_every_model_is_busy():
    """The registry's own QueueFull (what the routes answer 503 to and batch lines wait on)."""
    built = []
    models = ModelRegistry({"a": "A", "b": "B"}, lambda name, path, adapters: built.append(name) or _Idle(),
                           max_loaded=1, slot_wait=0.05)

    async def scenario() -> None:
        async with models.lease("a"):
            with pytest.raises(QueueFull):
                async with models.lease("b"):
                    pass
        async with models.lease("b"):
            assert models.entries["a"].state == "unloaded"

    asyncio.run(scenario())
    assert built == ["a", "b"]


class _Idle:
    """A served model's stand-in for the registry's bookkeeping alone (what it unloads)."""

    adapters: dict = {}

    class engine:  # noqa: N801
        @staticmethod
        def shutdown() -> None:
            pass


def test_models_preset_gives_each_model_its_own_engine_flags(tmp_path):
    """--models-preset (llama.cpp's INI presets): [*] for every model, [NAME] its own, `model = PATH` a model
    the command line does not name; the own section wins over [*], which wins over the command line."""
    preset = tmp_path / "models.ini"
    preset.write_text("[*]\nmax-num-seqs = 3\nkv-cache-ram = 64MiB\n\n[tiny]\nkv-cache-dtype = q8_0\nmax-num-seqs = 2\n\n"
                      "[other]\nmodel = builtin\nno-prefix-caching = true\nlora = a=/x, b=/y\n")
    args = serve_args("--model", "tiny=builtin", "--models-preset", str(preset), "--kv-cache-dtype", "float16")
    models = models_from_args(args, ServerLimits())
    assert {n: e.path for n, e in models.entries.items()} == {"tiny": "builtin", "other": "builtin"}
    assert models.entries["other"].adapters == {"a": "/x", "b": "/y"}
    served = models.build("tiny", "builtin", {})  # an engine built with them
    tiny = served.engine.engine.config
    served.engine.shutdown()
    own = ModelPresets(preset).check(["tiny", "other"])["other"]  # (the other's config, as its build reads it)
    other = EngineConfig.from_options(**engine_options(model_args(args, "builtin", own)) | {"lora_modules": ()})
    assert (tiny.cache.kv_cache_dtype, tiny.scheduler.max_num_seqs, tiny.cache.enable_prefix_caching) == ("q8_0", 2, True)
    assert (other.cache.kv_cache_dtype, other.scheduler.max_num_seqs, other.cache.enable_prefix_caching) == (
        "float16", 3, False)
    assert tiny.cache.kv_cache_ram == other.cache.kv_cache_ram == 64 << 20
    for text, error in (("[tiny]\nkv-cache-dtyp = q8_0\n", "did you mean 'kv-cache-dtype'"),
                        ("[tiny]\nmax-num-seqs = many\n", "max-num-seqs = many"),
                        ("[nobody]\nmax-num-seqs = 2\n", r"\[nobody\] is no model served"),
                        ("[tiny]\nthreads = 2\n", "the process's own"), ("max-num-seqs = 2\n", "no section headers")):
        preset.write_text(text)
        with pytest.raises(HearthError, match=error):
            models_from_args(args, ServerLimits())
