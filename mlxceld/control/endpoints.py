"""The control API's endpoints: one method each, over the parts of the daemon its
``DaemonView`` holds.

An endpoint reads its request (``requests.py``), asks the daemon, and shapes
the answer ``{"schema": "mlxceld.NAME/1", "version": V, ...}``. It answers no
error itself: what it or the daemon raises is answered by ``errors.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxceld import __version__
from mlxceld.control import clusterview
from mlxceld.control.requests import (
    DrainRequest,
    LinkTestRequest,
    PlanRequest,
    RotateRequest,
    SecretRequest,
    ServeRequest,
    flag_param,
    int_param,
    text_param,
)
from mlxceld.control.streams import NDJSON, event_lines, log_lines
from mlxceld.control.view import DaemonView
from mlxceld.errors import ShuttingDown, UnknownWorker
from mlxceld.supervisor import health
from mlxceld.types import JSON, PipelineView

API_VERSION: Final = 1
MAX_LINES: Final = 10_000
MAX_EVENTS: Final = 1_000


def answer(schema: str, status: int = 200, **fields: Any) -> JSONResponse:
    return JSONResponse({"schema": f"mlxceld.{schema}/1", "version": __version__, **fields},
                        status_code=status)


class Endpoints:
    def __init__(self, view: DaemonView) -> None:
        self.view = view

    # -- reading ---------------------------------------------------------------------------

    async def version(self, request: Request) -> Response:
        return answer("version", api=API_VERSION)

    async def status(self, request: Request) -> Response:
        view = self.view
        current = view.daemon.status()
        # the daemon's problems are its workers' (recomputed below with their stats: the
        # stage links) followed by the cluster's (the failure detector, self-healing)
        cluster = current["problems"][len(health.problems(current["workers"])):]
        stats = await view.workers.stats()  # bounded: supervisor.STATS_TIMEOUT_S
        for w in current["workers"]:
            w["stats"] = stats.get(w["name"])
        pipeline = (self._pipeline(current) if clusterview.serves_pipeline(current)
                    else None)
        current["pipeline"] = pipeline
        # The drains in force here, whatever this node serves (a single node's own too).
        current["drains"] = (pipeline["drains"] if pipeline is not None
                             else [d.to_json() for d in view.drains.list()])
        current["problems"] = clusterview.name_nodes(
            health.problems(current["workers"]) + cluster + clusterview.problems(pipeline),
            pipeline)
        return answer("status", **current)

    async def workers(self, request: Request) -> Response:
        return answer("workers", workers=[w.to_json() for w in self.view.workers.snapshot()])

    async def cluster_nodes(self, request: Request) -> Response:
        return answer("cluster_nodes", **self.view.cluster.nodes().to_json())

    async def logs(self, request: Request) -> Response:
        path = self._log_path(request.path_params["name"])
        lines = int_param(request, "lines", 50, 0, MAX_LINES)
        follow = flag_param(request, "follow")
        return StreamingResponse(log_lines(self.view.daemon.stopping, path, lines, follow),
                                 media_type=NDJSON)

    async def events(self, request: Request) -> Response:
        after = int_param(request, "after", -20, -MAX_EVENTS, 2**62)
        limit = int_param(request, "limit", 100, 1, MAX_EVENTS)
        subject = text_param(request, "subject")
        if not flag_param(request, "follow"):
            items = [e.to_json() for e in self.view.events.since(after, limit, subject)]
            return answer("events", events=items)
        return StreamingResponse(event_lines(self.view.events, self.view.daemon.stopping, after,
                                             limit, subject), media_type=NDJSON)

    # -- workers and serving ---------------------------------------------------------------

    async def restart(self, request: Request) -> Response:
        name = request.path_params["name"]
        self._admitting()
        self._log_path(name)
        self.view.workers.restart(name)
        return answer("restart", worker=name, restarting=True)

    async def serve(self, request: Request) -> Response:
        self._admitting()
        asked = await ServeRequest.read(request)
        served = await self.view.serving.serve_model(asked.model, asked.model_name)
        return answer("serve", serving=served.to_json() if served else None)

    async def unserve(self, request: Request) -> Response:
        self._admitting()
        return answer("unserve", **(await self.view.serving.unserve()).to_json())

    async def reload(self, request: Request) -> Response:
        """Re-read the config file as SIGHUP does: what changed, or the error (a 400 naming
        the file and key) with the running config kept."""
        self._admitting()
        return answer("reload", **(await self.view.daemon.reload()).to_json())

    async def stop(self, request: Request) -> Response:
        self.view.daemon.request_stop()
        return answer("stop", stopping=True, pid=self.view.daemon.status()["daemon"]["pid"])

    # -- the cluster -----------------------------------------------------------------------

    async def plan(self, request: Request) -> Response:
        asked = await PlanRequest.read(request, "plan")
        proposal = await self.view.cluster.plan(asked.model, asked.stages, asked.replicas,
                                                asked.mesh)
        return answer("cluster_plan", **proposal.to_json())

    async def activate(self, request: Request) -> Response:
        """Plan now, push and serve in the background: 202 with the bring-up (its epoch);
        `GET /v1/status` shows its progress as ``bringup``."""
        self._admitting()
        asked = await PlanRequest.read(request, "activate")
        state = await self.view.cluster.activate(asked.model, asked.stages, asked.replicas,
                                                 asked.mesh)
        return answer("cluster_activate", 202, bringup=state)

    async def deactivate(self, request: Request) -> Response:
        """End the plan on every peer and stop the router (at most ``deactivation`` bounds:
        a dial and an answer per peer, in parallel, and the router's stop)."""
        self._admitting()
        return answer("cluster_deactivate", bringup=await self.view.cluster.deactivate())

    async def link_test(self, request: Request) -> Response:
        """Round trips and bandwidth both ways with a peer's agent (``net/link.py``: at most
        its ``CONNECT_S + TEST_S``)."""
        self._admitting()
        asked = await LinkTestRequest.read(request)
        report = await self.view.links.link_test(asked.peer, asked.pings, asked.size)
        return answer("cluster_link_test", **report.to_json())

    # -- drains ----------------------------------------------------------------------------

    async def drains(self, request: Request) -> Response:
        return answer("drains", drains=[d.to_json() for d in self.view.drains.list()])

    async def drain(self, request: Request) -> Response:
        self._admitting()
        asked = await DrainRequest.read(request, "drain")
        row = self.view.drains.drain(asked.node, asked.deadline_s, asked.force)
        return answer("drain", drain=row.to_json())

    async def undrain(self, request: Request) -> Response:
        asked = await DrainRequest.read(request, "undrain")
        return answer("undrain", **self.view.drains.undrain(asked.node).to_json())

    # -- cluster secrets -------------------------------------------------------------------

    async def secrets(self, request: Request) -> Response:
        rotation = self.view.cluster.rotation()
        return answer("secrets", keys=[k.to_json() for k in self.view.secrets.list()],
                      rotation=rotation.to_json() if rotation else None)

    async def rotate_secret(self, request: Request) -> Response:
        """The rotation's row once done. Without a secret: the latest rotation taken up
        again if it failed, else a new one to a generated secret (as `mlxctl secret
        generate` makes one; ``cluster/rotation.py``)."""
        self._admitting()
        asked = await RotateRequest.read(request)
        rotation = await self.view.cluster.rotate(asked.secret)
        return answer("rotation", rotation=rotation.to_json())

    async def install_secret(self, request: Request) -> Response:
        asked = await SecretRequest.read(request)
        key = await self.view.secrets.install_secret(asked.secret, asked.primary, asked.source)
        return answer("secret", key=key.to_json())

    async def use_secret(self, request: Request) -> Response:
        key = await self.view.secrets.use_secret(request.path_params["kid"])
        return answer("secret", key=key.to_json())

    async def remove_secret(self, request: Request) -> Response:
        key = await self.view.secrets.remove_secret(request.path_params["kid"])
        return answer("secret", key=key.to_json(), removed=True)

    # -- checks ----------------------------------------------------------------------------

    def _pipeline(self, current: JSON) -> PipelineView | None:
        """The cluster view of ``current`` (the status): in memory, no peer asked."""
        view = self.view
        nodes = view.cluster.nodes().to_json()
        drains = [d.to_json() for d in view.drains.list()]
        rotation = view.cluster.rotation()
        return clusterview.pipeline_view(current, nodes, drains,
                                         rotation.to_json() if rotation else None)

    def _admitting(self) -> None:
        if self.view.daemon.stopping():
            raise ShuttingDown("the daemon is shutting down and admits no new work",
                               hint="wait for it to stop, then start it again")

    def _log_path(self, name: str) -> Path:
        path = self.view.workers.log_path(name)
        if path is None:
            raise UnknownWorker(f"no worker named {name!r}",
                                hint="see `mlxctl workers` for the names")
        return Path(path)
