"""A non-streaming response encoded to JSON in slices, yielding the event loop between them.

A completion with logprobs holds n x tokens x (top k + 1) entries: 16 choices of 1,000 tokens with the top 20 are
~19 MB of JSON. FastAPI's default path (jsonable_encoder, then json.dumps) walks that in one go on the front end's
event loop, and every other stream waits: 8.5 s for that body on the project's CPU (the OpenAI audit of
2026-12-06). Here the body is encoded with json.dumps directly, a list of more than SLICE elements SLICE at a time,
with `await asyncio.sleep(0)` between slices, so that no slice holds the loop for more than a few milliseconds.
The bytes are the same as `json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`, where a `RawJSON` value
stands for the value whose JSON text it holds: a handler that keeps a long answer's logprobs as text (one string an
event) holds a few objects instead of millions of small dicts, which the garbage collector would rescan while the
answer grows (0.6-1.8 s pauses of the other streams near the entry limit).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

SLICE = 256  # list elements encoded between two yields (a chat logprob entry with its top 20: ~2 KB)
_DUMPS = {"ensure_ascii": False, "separators": (",", ":")}


class RawJSON(str):
    """JSON text written into the body as it is (encode_yielding), in place of the value it encodes."""


def dumps(obj: Any) -> str:
    """The compact JSON text encode_yielding writes for `obj` (no RawJSON inside)."""
    return json.dumps(obj, **_DUMPS)


async def encode_yielding(obj: Any) -> bytes:
    parts: list[str] = []
    await _encode(obj, parts)
    return "".join(parts).encode()


async def _encode(obj: Any, parts: list[str]) -> None:
    if isinstance(obj, RawJSON):
        parts.append(obj)
        await asyncio.sleep(0)
    elif isinstance(obj, dict):
        parts.append("{")
        for i, (k, v) in enumerate(obj.items()):
            parts.append(("," if i else "") + json.dumps(str(k), **_DUMPS) + ":")
            await _encode(v, parts)
        parts.append("}")
    elif isinstance(obj, (list, tuple)) and len(obj) > SLICE:
        parts.append("[")
        for start in range(0, len(obj), SLICE):
            parts.append(("," if start else "") + json.dumps(list(obj[start : start + SLICE]), **_DUMPS)[1:-1])
            await asyncio.sleep(0)
        parts.append("]")
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, (dict, list, tuple)) for x in obj):
        parts.append("[")  # a short list of large things (the choices): each element on its own
        for i, x in enumerate(obj):
            if i:
                parts.append(",")
            await _encode(x, parts)
        parts.append("]")
    else:
        parts.append(json.dumps(obj, **_DUMPS))
