"""What the OpenAPI document says about errors: each status's meaning and JSON body, listed per route (a test
checks each route answers only what it lists: tests/faults/test_fuzz_http.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from probe_service.schemas import Problem, ValidationProblem

# What each status means, for the OpenAPI schema (every route lists the ones it can answer; a test checks).
STATUS = {
    400: "a malformed request: a Host this service does not answer to (allowed_hosts), '..' in a path, a bad "
         "checkpoint, task, dataset or reward, ?checkpoint= missing where the job has several",
    401: "no token or a wrong one (`authorization: Bearer <token>`)",
    403: "a path outside the service's allowed roots (symlinks followed)",
    404: "no such job, step, checkpoint, path or output",
    409: "the job is not done yet (outputs), already finished (cancel), or was cancelled (?wait=true)",
    413: "the body is larger than max_body_bytes",
    415: "the body is not `application/json`",
    422: "a field out of range or of the wrong type (names the field), or a job larger than the service's caps "
         "(max_job_samples, max_job_tokens, max_job_positions; names the setting)",
    429: "the queue is full (Retry-After)",
    500: "?wait=true: the job failed (its error)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of these error statuses: what each means and its JSON body."""
    return {c: {"description": STATUS[c], "model": ValidationProblem if c == 422 else Problem} for c in codes}


def declare_json_errors(app: FastAPI) -> None:
    """Every error answer is JSON, but FastAPI files an error response's model under the route's own media type
    (text/plain for /metrics, image/png for the plots): the schema is built as FastAPI builds it, then each error
    body is moved under application/json (FastAPI's documented way to change the schema: replace app.openapi)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for operations in build()["paths"].values():  # build() caches the schema it returns: fixed in place
                for operation in operations.values():
                    for code, response in operation.get("responses", {}).items():
                        content = response.get("content", {})
                        if code[0] in "45" and content and "application/json" not in content:
                            response["content"] = {"application/json": next(iter(content.values()))}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
