"""The OpenAPI 3.1 document, generated from the same msgspec types that decode the requests."""

from __future__ import annotations

from typing import Any

import msgspec

from ..stores.wire import ENDPOINTS, ErrorReply

__all__ = ["document"]

_ERRORS = {
    "400": "Malformed JSON, a wrongly typed or out-of-range field, or an unknown field; nothing was changed.",
    "401": "The server has a token and the request did not carry it as `Authorization: Bearer <token>`.",
    "413": "The request body is larger than the server's limit.",
    "415": "The request body is not `application/json`.",
    "500": "An unexpected server error; it is logged.",
    "503": "The backing store failed; the client should execute without the cache.",
}


def document(version: str) -> dict[str, Any]:
    types: list[Any] = [ErrorReply]
    for endpoint in ENDPOINTS:
        if endpoint.request is not None:
            types.append(endpoint.request)
        types.append(endpoint.reply)
    refs, schemas = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    error_ref, rest = refs[0], iter(refs[1:])
    paths: dict[str, Any] = {}
    for endpoint in ENDPOINTS:
        request_ref = next(rest) if endpoint.request is not None else None
        reply_ref = next(rest)
        operation: dict[str, Any] = {
            "operationId": endpoint.name,
            "summary": endpoint.summary,
            "responses": {
                "200": {"description": "Done.", "content": {"application/json": {"schema": reply_ref}}},
                **{
                    code: {"description": text, "content": {"application/json": {"schema": error_ref}}}
                    for code, text in _ERRORS.items()
                    if (code != "401" or endpoint.auth) and (code not in ("413", "415") or request_ref)
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
                "401": {"description": _ERRORS["401"], "content": {"application/json": {"schema": error_ref}}},
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tvcache server",
            "version": version,
            "description": "The tvcache store interface over HTTP: one POST per store operation, JSON bodies, "
            "bytes as base64 strings. With a token set, every /v1 path and /metrics need "
            "`Authorization: Bearer <token>`.",
        },
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def encoded(version: str) -> bytes:
    return msgspec.json.encode(document(version))
