"""What the LLM server's routes need from an engine, and that interface over an in-process `sglx.Engine`.

`sglx serve` runs the engine in a process of its own (sglx.server.engine_client.EngineClient); `create_app` also
takes a `sglx.Engine` built in the caller's process (InProcessEngine), e.g. to serve an engine a Python program
already holds. Either way the routes see the same small surface: the tokenizer and model limits, which never
change, and awaitable calls for load, flush and generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from sglx.llm.engine import Engine
from sglx.llm.engine_config import EngineConfig
from sglx.llm.sampling import SamplingParams


class ServedEngine(Protocol):
    tokenizer: Any  # sglx.llm.tokenizer.Tokenizer, or None for models without one (token ids only)
    config: EngineConfig
    model_path: str
    vocab_size: int
    context_length: int
    capacity: int  # tokens one request may occupy at most (prompt + output)

    @property
    def info(self) -> dict[str, Any]: ...  # what runs (Engine.info) as of start-up

    async def health(self) -> tuple[bool, str | None]: ...  # (scheduler alive, why it cannot serve: one line)

    def generate_stream(self, prompt: Any, sampling_params: SamplingParams, input_ids: Sequence[int],
                        return_logprob: bool = False, top_logprobs: int = 0) -> AsyncIterator[dict[str, Any]]: ...

    async def load(self) -> dict[str, int]: ...  # sglx.server.engine_state.engine_load's numbers

    async def current_info(self) -> dict[str, Any]: ...  # Engine.info now

    async def flush_cache(self) -> int: ...

    def shutdown(self) -> None: ...


class InProcessEngine:
    """ServedEngine over an `sglx.Engine` in this process (its scheduler thread shares this process's GIL)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.model_path = str(engine.runner.model_path)
        self.vocab_size = int(engine.model_config.vocab_size)
        self.context_length = int(engine.runner.memory.context_length)
        self.capacity = int(engine.scheduler.capacity())

    @property
    def info(self) -> dict[str, Any]:
        return self.engine.info

    async def health(self) -> tuple[bool, str | None]:
        failure = self.engine.failure  # a broken tensor-parallel group: its one line
        return self.engine.scheduler.alive, None if failure is None else str(failure)

    def generate_stream(self, prompt: Any, sampling_params: SamplingParams, input_ids: Sequence[int],
                        return_logprob: bool = False, top_logprobs: int = 0) -> AsyncIterator[dict[str, Any]]:
        return self.engine.generate_stream(prompt, sampling_params, input_ids=input_ids,
                                           return_logprob=return_logprob, top_logprobs=top_logprobs)

    async def load(self) -> dict[str, int]:
        from sglx.server.engine_state import engine_load

        return await asyncio.to_thread(engine_load, self.engine)

    async def current_info(self) -> dict[str, Any]:
        return self.engine.info

    async def flush_cache(self) -> int:
        return await asyncio.to_thread(self.engine.flush_cache)

    def shutdown(self) -> None:
        self.engine.shutdown()
