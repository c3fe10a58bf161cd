"""Request bodies that are JSON or HTML forms (OpenAI's client sends /v1/videos as multipart/form-data).

Form fields arrive as strings; the caller validates them in pydantic's lax mode so "5" becomes 5.
Multipart is parsed with the standard library's email parser (no python-multipart dependency).
"""

from __future__ import annotations

from email.parser import BytesParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Request

from sglx.server.errors import bad_request
from sglx.server.request_body import parse_json

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def parse_multipart(raw: bytes, content_type: str) -> dict[str, Any]:
    """Text fields as str; file parts as bytes (named by their field)."""
    if "boundary=" not in content_type:
        raise bad_request("multipart/form-data without a boundary in Content-Type", code="invalid_form")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n"
                                                 + raw)
    if not message.is_multipart():
        raise bad_request("the multipart body could not be parsed", code="invalid_form")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise bad_request("a multipart field has no name", code="invalid_form")
        payload = part.get_payload(decode=True) or b""
        if part.get_filename() is not None:
            fields[str(name)] = payload
            continue
        try:
            fields[str(name)] = payload.decode(part.get_content_charset() or "utf-8")
        except (UnicodeDecodeError, LookupError):
            raise bad_request(f"form field '{name}' is not valid UTF-8 text", str(name), "invalid_form") from None
    return fields


async def parse_json_or_form(request: Request) -> tuple[dict[str, Any], bool]:
    """(fields, is_form): the body as a dict, and whether it came from a form (values are strings)."""
    content_type = request.headers.get("content-type", "")
    kind = content_type.split(";", 1)[0].strip().lower()
    raw = await request.body()
    if kind == "multipart/form-data":
        return parse_multipart(raw, content_type), True
    if kind == "application/x-www-form-urlencoded":
        try:
            return dict(parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)), True
        except UnicodeDecodeError:
            raise bad_request("the form body is not valid UTF-8", code="invalid_form") from None
    return parse_json(raw), False
