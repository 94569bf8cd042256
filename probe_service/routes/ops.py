"""The operator's routes: GET /healthz (open: liveness probes) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from probe_service.deps import ManagerDep

open_router = APIRouter()  # never needs the token
router = APIRouter()
_PROMETHEUS = {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}


@open_router.get("/healthz")
def healthz(manager: ManagerDep) -> dict:
    return {"status": "ok", "jobs": manager.counts()}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition", "content": _PROMETHEUS}})
def metrics(manager: ManagerDep) -> Response:
    return Response(generate_latest(manager.registry), media_type=CONTENT_TYPE_LATEST)
