"""``tlt-serve serve``: start the engine process, then the HTTP server (uvicorn)."""

from __future__ import annotations

import asyncio
import logging
import sys
from types import FrameType

import uvicorn

from tlt_serve.config import ServerConfig
from tlt_serve.fleet.join import JoinError, join_fleet
from tlt_serve.fleet.router_api import RouterApi, RouterError
from tlt_serve.server.app import build_app
from tlt_serve.server.common.bridge import Bridge, EngineStartError
from tlt_serve.server.common.training import TrainerSupervisor, TrainingState

GRACEFUL_SHUTDOWN_S = 30  # after aborting, how long in-flight responses get to be written

log = logging.getLogger("tlt_serve.serve")


class _Server(uvicorn.Server):
    """uvicorn plus: a ready line once bound, and aborts on SIGTERM/SIGINT.

    Aborting before uvicorn's graceful wait makes every in-flight request finish now with
    its partial output (finish_reason abort) instead of holding shutdown until it completes.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        bridge: Bridge,
        server_config: ServerConfig,
        training: TrainingState,
    ) -> None:
        super().__init__(config)
        self.bridge = bridge
        self.server_config = server_config
        self.training = training
        self.model = server_config.served_model_name or server_config.engine.model.model
        self.trainer: TrainerSupervisor | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.bridge.closing = True  # new requests get 503 from here on
        self.bridge.abort_all()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        if self.server_config.register:
            await asyncio.to_thread(self._leave_router)
        if self.trainer is not None:
            await asyncio.to_thread(self.trainer.stop)
        await super().shutdown(sockets)
        # uvicorn re-raises a caught SIGTERM/SIGINT once serving ends, which ends the process
        # on the spot: stop the engine process cleanly before that.
        await asyncio.to_thread(self.bridge.shutdown)

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(f"tlt-serve ready: http://{host}:{port} (model {self.model})", flush=True)
        if self.server_config.register:
            await asyncio.to_thread(self._join_router)
        if self.server_config.training.enabled:
            url = f"http://{host}:{port}"
            self.trainer = TrainerSupervisor(self.server_config, url, self.training)
            self.bridge.load_listeners.append(self.trainer.on_load)
            self.trainer.start()


    def _join_router(self) -> None:
        cfg = self.server_config
        assert cfg.register is not None
        try:  # the fleet's current weights and drafter first, then requests
            joined = join_fleet(cfg.register, cfg.own_url, api_key=cfg.api_key)
        except (RouterError, JoinError) as err:  # serving goes on; the operator sees why
            log.error("could not join the router's fleet: %s", err)
            return
        print(f"tlt-serve registered {cfg.own_url} with {cfg.register} (weight version "
              f"{joined.weight_version}, drafter version {joined.drafter_version})", flush=True)

    def _leave_router(self) -> None:
        cfg = self.server_config
        assert cfg.register is not None
        try:
            RouterApi(cfg.register).remove(cfg.own_url)
        except RouterError as err:
            log.warning("could not deregister from the router: %s", err)


def serve(config: ServerConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    bridge = Bridge(config.engine, config.log_level, config.request_timeout_s)
    try:
        bridge.start()
    except EngineStartError as err:
        print(f"tlt-serve: {err}", file=sys.stderr)
        return 1
    try:
        app = build_app(config, bridge)
        log.info("tool calls in chat answers: %s", app.state.tlt.tool_parser or "not parsed "
                 "(no --tool-call-parser, and the chat template shows no format it knows)")
        uv_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        _Server(uv_config, bridge, config, app.state.tlt.training).run()
    finally:
        bridge.shutdown()
    return 0
