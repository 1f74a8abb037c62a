"""One HTTP response from a Generator request: a JSON body, or server-sent events.

A streamed response starts once the first tokens are there, so refusals that come from the verifier (a full
queue: 429) still get their own status; a failure after that is an error event before ``data: [DONE]``. When
the client goes away (streaming or not) the request is cancelled at once and the verifier frees its slots.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..generator import Generator, PromptRequest, Refused
from . import errors


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def respond(generator: Generator, request: Request, prompt: PromptRequest, fmt, rid: str, stream: bool,
                  names: dict[str, str]) -> Response:
    try:
        prepared = await generator.prepare(prompt, "http")
        responses = generator.stream(rid, prepared)
        try:
            if not stream:
                return JSONResponse(fmt.full(await _until_disconnect(request, _collect(responses))))
            first = await _until_disconnect(request, anext(responses))
        except BaseException:
            await responses.aclose()   # cancels the verifier call if it still runs
            raise
    except Refused as e:
        return errors.response(errors.from_refused(e, names))
    return EventStream(_events(fmt, first, responses), responses)


async def _collect(responses) -> list:
    return [r async for r in responses]


async def _until_disconnect(request: Request, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))   # its cleanup (the verifier call cancelled) has run
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(fmt, first, responses):
    """SSE events: the opening chunk(s), one chunk per message, the usage chunk if asked, then [DONE]."""
    for event in fmt.opening():
        yield _sse(event)
    response = first
    try:
        while True:
            event = fmt.chunk(response)
            if event is not None:
                yield _sse(event)
            if response.finish_reason:
                if fmt.include_usage:
                    yield _sse(fmt.usage_chunk(response.usage))
                break
            response = await anext(responses)
    except Refused as e:  # the stream has begun (status 200): the error goes in an event of its own
        error = errors.from_refused(e, {})
        yield _sse(errors.body(error.status, error.message, error.param, error.code))
    yield "data: [DONE]\n\n"


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """text/event-stream; however the response ends (done, client gone, server stopping) the generation is closed,
    which cancels its verifier call."""

    def __init__(self, events, generation):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._generation.aclose()
