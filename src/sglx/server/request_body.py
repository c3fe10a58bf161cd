"""Read and validate a JSON request body, turning every problem into a 400 that names the parameter."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from sglx.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})  # pydantic's union-member tags


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    return data


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or "(" in str(part) or str(part).startswith("function-") or part in TYPE_TAGS:
            continue  # pydantic's union-member / validator tags, not a field
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error(exc: ValidationError, fields: set[str]) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not param:  # a whole-object check; its message starts with the field it is about
        word = msg.split(" ", 1)[0]
        param = word if word in fields else ""
        message = msg
    elif first["type"] == "extra_forbidden":
        message = f"unsupported parameter '{param}': sglx does not implement it; remove it from the request"
    elif first["type"] == "missing":
        message = f"'{param}' is required"
    else:
        given = first.get("input")
        shown = json.dumps(given)[:80] if isinstance(given, (str, int, float, bool)) or given is None else None
        message = f"{param}: {msg}" + (f" (got {shown})" if shown is not None else "")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param or None, first["type"])


def validate_body(model: type[M], data: dict[str, Any], lax: bool = False) -> M:
    """`model` from a parsed body; lax for form fields, which are all strings."""
    try:
        return model.model_validate(data, strict=False if lax else None)
    except ValidationError as exc:
        raise validation_error(exc, set(model.model_fields)) from None


async def parse_body(request: Request, model: type[M]) -> M:
    return validate_body(model, parse_json(await request.body()))
