"""`create_app(engine)` over an sglx.Engine the caller already holds (no engine process): the same routes answer
what the engine itself generates, and /server_info reads the engine's own load."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from server_test_utils import model_path
from sglx.llm.engine import Engine
from sglx.server.app import create_app

PROMPT = "k3=abcd; k7=efgh; k12=wxyz; ? k7="


def test_app_over_an_in_process_engine_matches_the_engine(tmp_path: Path) -> None:
    with Engine(model_path=str(model_path(tmp_path)), max_total_tokens=2048, dtype="float32") as engine:
        want = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        app = create_app(engine)

        async def ask() -> tuple[Any, Any, list[str], Any]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sglx") as client:
                body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
                plain = (await client.post("/v1/completions", json=body)).json()
                streamed = (await client.post("/v1/completions", json={**body, "stream": True})).text
                events = [line[6:] for line in streamed.splitlines() if line.startswith("data: ")]
                info = (await client.get("/server_info")).json()
                health = await client.get("/health")
                return plain, info, events, health

        plain, info, events, health = asyncio.run(ask())
        slots = engine.runner.memory.num_slots
    assert plain["choices"][0]["text"] == want["text"]
    assert plain["usage"]["completion_tokens"] == 8
    assert events[-1] == "[DONE]" and len(events) > 2
    assert info["kv_pool"]["total"] == slots
    assert info["scheduler"] == {"running_requests": 0, "queued_requests": 0}
    assert health.status_code == 200
