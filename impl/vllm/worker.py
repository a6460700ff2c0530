"""vLLM inside a worker process (:mod:`impl.worker`): the driver's requests.

:class:`impl.vllm.VllmTarget` starts ``python -m impl.worker`` with that vLLM
first on ``PYTHONPATH`` and ``KVCHECK_WORKER_SETUP=impl.vllm.worker:setup``:
:func:`setup` imports vLLM, warms a scheduler up and serves, besides the
worker's jobs (a fuzz run or a replay, whose target then calls
:class:`DriverOps` in the same process):

* ``("reset", s, config)``   -> ``("ok", Observed)`` / ``("unsupported", line)``
* ``("apply", s, [events])`` -> ``("ok", [Observed, ...])``, or, when event i
  fails, ``(kind, message, [Observed of events < i])`` with kind
  ``unsupported`` / ``rejected`` / ``crash`` (message: the traceback)
* ``("drop", s, None)``      -> ``("ok", None)``

One driver per session: several targets of one version share the process,
not the state.
"""

from __future__ import annotations

import traceback
from typing import Any

from impl.worker import recv, send  # noqa: F401 - the protocol, for callers

OPS: DriverOps | None = None


class DriverOps:
    """The drivers of one process, one per session."""

    def __init__(self) -> None:
        from .driver import ConfigUnsupported, Driver, EventRejected, EventUnsupported

        self.Driver = Driver
        self.errors = (ConfigUnsupported, EventUnsupported, EventRejected)
        self.proto = Driver()
        self.proto.warm_up()
        self.drivers: dict[Any, Any] = {}

    def info(self) -> dict[str, Any]:
        return self.proto.info()

    def driver(self, session: Any) -> Any:
        d = self.drivers.get(session)
        if d is None:
            d = self.drivers[session] = (self.proto if not self.drivers
                                         and self.proto.sched is None else self.Driver())
        return d

    def handle(self, op: str, session: Any, payload: Any) -> Any:
        config_unsupported, event_unsupported, event_rejected = self.errors
        if op == "drop":
            self.drivers.pop(session, None)
            return ("ok", None)
        d = self.driver(session)
        if op == "reset":
            try:
                return ("ok", d.reset(payload))
            except config_unsupported as e:
                d.sched = None
                return ("unsupported", str(e))
            except Exception:  # noqa: BLE001
                d.sched = None
                return ("crash", traceback.format_exc())
        if op == "apply":
            done: list[Any] = []
            for ev in payload:
                try:
                    done.append(d.apply(ev))
                except event_unsupported as e:
                    return ("unsupported", str(e), done)
                except event_rejected as e:
                    return ("rejected", str(e), done)
                except Exception:  # noqa: BLE001 - vLLM (or the instrumentation) raised
                    d.sched = None  # its state is unknown now: reset() before more events
                    return ("crash", traceback.format_exc(), done)
            return ("ok", done)
        return ("crash", f"unknown request {op!r}")


def setup() -> tuple[dict[str, Any], dict[str, Any]]:
    """Import vLLM (the first scheduler pays for its lazy imports) and serve
    the driver's requests."""
    global OPS
    OPS = DriverOps()
    ops = OPS
    return ops.info(), {op: (lambda s, p, op=op: ops.handle(op, s, p))
                        for op in ("reset", "apply", "drop")}
