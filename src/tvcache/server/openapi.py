"""OpenAPI 3.1 documents, generated from the same msgspec types that decode the requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..stores.wire import Endpoint, ErrorReply

__all__ = ["COMMON_ERRORS", "document", "encoded"]

# Answers every server may give; each server adds its own (the store failed, no such sandbox, ...).
COMMON_ERRORS = {
    "400": "Malformed JSON, a wrongly typed or out-of-range field, or an unknown field; nothing was changed.",
    "401": "The server has a token and the request did not carry it as `Authorization: Bearer <token>`.",
    "408": "The request body did not arrive within the server's read timeout; the connection is closed.",
    "413": "The request body is larger than the server's limit.",
    "415": "The request body is not `application/json`.",
    "500": "An unexpected server error; it is logged.",
}
_BODY_ONLY = ("408", "413", "415")  # answers about a request body: only for operations that take one


def document(
    endpoints: Sequence[Endpoint], *, title: str, description: str, version: str, errors: Mapping[str, str]
) -> dict[str, Any]:
    types: list[Any] = [ErrorReply]
    for endpoint in endpoints:
        if endpoint.request is not None:
            types.append(endpoint.request)
        types.append(endpoint.reply)
    refs, schemas = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    error_ref, rest = refs[0], iter(refs[1:])
    errors = dict(sorted({**COMMON_ERRORS, **errors}.items()))
    paths: dict[str, Any] = {}
    for endpoint in endpoints:
        request_ref = next(rest) if endpoint.request is not None else None
        reply_ref = next(rest)
        operation: dict[str, Any] = {
            "operationId": endpoint.name,
            "summary": endpoint.summary,
            "responses": {
                "200": {"description": "Done.", "content": {"application/json": {"schema": reply_ref}}},
                **{
                    code: {"description": text, "content": {"application/json": {"schema": error_ref}}}
                    for code, text in errors.items()
                    if (code != "401" or endpoint.auth) and (code not in _BODY_ONLY or request_ref)
                },
            },
        }
        if endpoint.auth:
            operation["security"] = [{"bearer": []}]
        if request_ref is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": request_ref}}}
        paths[endpoint.path] = {endpoint.method.lower(): operation}
    paths["/metrics"] = {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics (text exposition format).",
            "security": [{"bearer": []}],
            "responses": {
                "200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}},
                "401": {"description": errors["401"], "content": {"application/json": {"schema": error_ref}}},
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def encoded(endpoints: Sequence[Endpoint], **kwargs: Any) -> bytes:
    return msgspec.json.encode(document(endpoints, **kwargs))
