"""A graceful shutdown for `pyhlo serve`: on SIGTERM (or Ctrl-C) the server stops taking
requests (a 503 in OpenAI's shape, and /health answers 503 so a load balancer stops sending),
ends the requests still waiting for a batch line with a clear error, and lets the running
ones finish for up to `shutdown_timeout` seconds; whatever still runs then ends with an
error, and the server exits. A second signal exits at once, ending every request.

GracefulServer is uvicorn's Server with that first step put before uvicorn's own shutdown
(which closes the listening socket and waits for the open connections).
"""
from __future__ import annotations

import logging
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from serving.engine import Engine

log = logging.getLogger("pyhlo")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# How long uvicorn then waits for handlers to send what the engine has ended (seconds).
CONNECTIONS_TIMEOUT_S = 5


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains its engine before it stops; run() as uvicorn's."""

    def __init__(self, config: uvicorn.Config, engine: Engine,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = CONNECTIONS_TIMEOUT_S
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler (uvicorn installs it for SIGINT and SIGTERM): the first signal
        drains, a second one exits at once."""
        self._captured_signals.append(sig)
        if self.draining is not None:
            log.warning("pyhlo serve: a second signal: exiting now, ending every request")
            self.engine.fail_running("the server was stopped before this request finished")
            self.force_exit = self.should_exit = True
            return
        log.warning("pyhlo serve: shutting down: no new requests; the running ones have %g s to finish "
                    "(a second signal exits at once)", self.shutdown_timeout)
        self.engine.stop_accepting("the server is shutting down: send this request to another server "
                                   "or try again once it is back")
        self.engine.fail_waiting("the server is shutting down: this request was still waiting for a "
                                 "batch line and was not run")
        # Not in the signal handler itself: it runs on the event loop's thread, which must go on
        # serving the running requests meanwhile.
        self.draining = threading.Thread(target=self._drain, name="pyhlo-shutdown", daemon=True)
        self.draining.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while not self.engine.idle() and time.monotonic() < deadline and not self.force_exit:
            time.sleep(0.05)
        if not self.engine.idle():
            self.engine.fail_running(f"the server shut down before this request finished (it gives "
                                     f"running requests {self.shutdown_timeout:g} s: --shutdown-timeout)")
        self.should_exit = True
