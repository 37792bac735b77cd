"""The routes that run the server rather than the model: /health and /metrics for load
balancers and scrapers, and /reset_prefix_cache (vLLM's path) for benchmarks."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from iterserve.engine.serving_engine import REPLICA_OK, REPLICA_RESTARTING, ServingEngine
from iterserve.server.metrics import CONTENT_TYPE, ServerMetrics
from iterserve.server.protocol import ResetPrefixCacheResponse


def admin_routes(engine: ServingEngine) -> APIRouter:
    """Outside /v1 but meant to sit behind the API key: benchmarks call it between runs."""
    admin = APIRouter()

    @admin.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        """Forget the prefix cache's blocks that no running request holds."""
        dropped = await engine.reset_prefix_cache()
        return ResetPrefixCacheResponse(num_blocks_dropped=dropped)

    return admin


def status_routes(engine: ServingEngine, metrics: ServerMetrics) -> APIRouter:
    """Open to all: a load balancer or a scraper holds no API key."""
    status_router = APIRouter()

    @status_router.get("/health")
    async def health() -> Response:
        # 503 while warming up (compiling) and while draining too, so a load balancer sends
        # nothing before we are fast, and stops sending before we stop. A fleet with a
        # replica restarting or given up, but one serving, says "degraded" with a 200: it
        # does serve. Each replica's state, restarts and last death are listed.
        states = engine.replica_states()
        replicas = [replica.state for replica in states]
        extra: dict[str, object] = {}
        if states:
            extra["replicas"] = replicas
            extra["replica_restarts"] = [replica.restarts for replica in states]
            extra["replica_rerouted"] = [replica.rerouted for replica in states]
            extra["replica_last_death"] = [replica.last_death for replica in states]
        if compute := engine.served_model.compute:
            extra["model"] = compute  # which dtype, kernels and ISA serve, and why
        if engine.is_accepting and engine.is_ready:
            degraded = any(state != REPLICA_OK for state in replicas)
            return JSONResponse({"status": "degraded" if degraded else "ok", **extra})
        if not engine.is_healthy:
            # None serves: coming back (requests wait for it, up to a bound), or not.
            status = "restarting" if REPLICA_RESTARTING in replicas else "dead"
        elif not engine.is_ready:
            status = "warming up"
        else:
            status = "draining"
        return JSONResponse({"status": status, **extra}, status_code=503)

    @status_router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return status_router
