"""AsyncEngine: the engine on its own thread, outputs streamed to asyncio consumers."""

from __future__ import annotations

import asyncio
import time

import pytest

from hearth import LLM, SamplingParams
from hearth.engine_config import EngineConfig
from hearth.engine.async_engine import AsyncEngine, EngineStopped, QueueFull
from hearth.engine.engine import LLMEngine
from hearth.errors import RequestError
from models import make_hf_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("async-model") / "llama", "llama")


@pytest.fixture
def engine(folder):
    engine = AsyncEngine(LLMEngine(folder, EngineConfig.from_options(max_num_seqs=4), progress=False))
    yield engine
    engine.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run(engine: AsyncEngine, prompt, params):
    outputs = [out async for out in engine.generate(prompt, params)]
    return outputs


def test_concurrent_generates_equal_offline_and_grow(engine, folder):
    prompts = ["Once upon a time", "def fibonacci(n):", "The quick brown fox", "0123456789", "héllo wörld"]
    expected = LLM(folder, progress=False).generate(prompts, greedy(12), use_tqdm=False)

    async def main():
        return await asyncio.gather(*(run(engine, p, greedy(12)) for p in prompts))

    for outputs, reference in zip(asyncio.run(main()), expected):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative

    async def final_only():  # beside a streamed twin: the engine hands over its finished output alone
        final = await engine.add_request(prompts[0], greedy(12), final_only=True)
        streamed = await engine.add_request(prompts[0], greedy(12))
        await asyncio.sleep(0.5)  # (not consumed: what the engine thread hands over piles up)
        for _ in range(600):  # until both finished (30 s at most)
            if streamed._queue.qsize() and final._queue.qsize() and not engine.num_running:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        handed_over = final._queue.qsize(), streamed._queue.qsize()
        return handed_over, [o async for o in final]

    (num_final, num_streamed), outputs = asyncio.run(final_only())
    assert num_final == 1 and num_streamed > 1
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert engine.engine.block_manager.check_all_free()


def test_cancelled_consumer_aborts_and_frees_blocks(engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("Once upon a time", greedy(450)):
                started.set()

        tasks = [asyncio.create_task(consume()) for _ in range(3)]
        await started.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while engine.num_running + engine.num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_running == engine.num_waiting == 0
    assert engine.engine.block_manager.check_all_free() and not engine.engine.has_unfinished_requests()


def test_bad_requests_raise_request_error(engine):
    async def main():
        with pytest.raises(RequestError, match="context window"):
            await run(engine, list(range(5, 305)) * 2, greedy(1))
        with pytest.raises(RequestError, match="empty"):
            await run(engine, [], greedy(1))
        return await run(engine, "still serving", greedy(2))

    assert asyncio.run(main())[-1].finished


def test_queue_full_and_shutdown(folder):
    llm_engine = LLMEngine(folder, EngineConfig.from_options(max_num_seqs=1), progress=False)
    step = llm_engine.step
    llm_engine.step = lambda: (time.sleep(0.005), step())[1]  # slow enough to keep a queue
    engine = AsyncEngine(llm_engine, max_queue=1)

    async def main():
        first = await engine.add_request("Once upon a time", greedy(400))
        await first.__anext__()  # running
        second = await engine.add_request("Once upon a time", greedy(400))  # waits for the one seat
        with pytest.raises(QueueFull):
            await engine.add_request("Once upon a time", greedy(400))
        engine.shutdown()
        for stream in (first, second):
            with pytest.raises(EngineStopped):
                async for _ in stream:
                    pass
        with pytest.raises(EngineStopped):
            await engine.add_request("too late", greedy(1))

    asyncio.run(main())
    assert llm_engine.block_manager.check_all_free() and not llm_engine.has_unfinished_requests()


def test_build_on_passing_thread_returns_or_raises_on_the_callers_thread():
    """The engine built on a thread that has exited when it returns (its OpenMP team let go), the
    builder's value back, its exception raised here."""
    import threading

    from hearth.engine.async_engine import build_on_passing_thread

    seen = []
    assert build_on_passing_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="no model"):
        build_on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("no model")))
