"""The worker process: imports one vLLM and serves drivers over pipes.

Started by :class:`impl.vllm.VllmTarget` as ``python -m impl.vllm.worker``
with that vLLM first on ``PYTHONPATH``. Protocol: length-prefixed pickles
(4-byte little-endian length, then ``pickle.dumps(message)``) on the original
stdin/stdout; anything vLLM prints goes to stderr (the parent's log file).

Requests ``(op, session, payload)``:

* ``("reset", s, config)``   -> ``("ok", Observed)`` / ``("unsupported", line)``
* ``("apply", s, [events])`` -> ``("ok", [Observed, ...])``, or, when event i
  fails, ``(kind, message, [Observed of events < i])`` with kind
  ``unsupported`` / ``rejected`` / ``crash`` (message: the traceback)
* ``("drop", s, None)``      -> ``("ok", None)``
* ``("quit", None, None)``   -> exits

The first message the worker sends is ``("ready", info)`` once vLLM is
imported (or ``("crash", traceback)`` if it cannot be). One driver per
session: several targets of one version share the process, not the state.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
from typing import Any, BinaryIO

_HEADER = struct.Struct("<I")


def send(out: BinaryIO, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)))
    out.write(data)
    out.flush()


def recv(inp: BinaryIO) -> Any:
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    (n,) = _HEADER.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def main() -> None:
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray output of vLLM goes to the log, never into the protocol

    try:
        from .driver import (
            ConfigUnsupported,
            Driver,
            EventRejected,
            EventUnsupported,
        )

        proto = Driver()
        proto.warm_up()
        info = proto.info()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        send(out, ("crash", traceback.format_exc()))
        return
    send(out, ("ready", info))

    drivers: dict[Any, Driver] = {}

    def driver(session: Any) -> Driver:
        d = drivers.get(session)
        if d is None:
            d = drivers[session] = proto if not drivers and proto.sched is None else Driver()
        return d

    while True:
        try:
            op, session, payload = recv(inp)
        except EOFError:
            return
        if op == "quit":
            return
        if op == "drop":
            drivers.pop(session, None)
            send(out, ("ok", None))
            continue
        d = driver(session)
        if op == "reset":
            try:
                send(out, ("ok", d.reset(payload)))
            except ConfigUnsupported as e:
                d.sched = None
                send(out, ("unsupported", str(e)))
            except Exception:  # noqa: BLE001
                d.sched = None
                send(out, ("crash", traceback.format_exc()))
        elif op == "apply":
            done: list[Any] = []
            reply: Any = None
            for ev in payload:
                try:
                    done.append(d.apply(ev))
                except EventUnsupported as e:
                    reply = ("unsupported", str(e), done)
                except EventRejected as e:
                    reply = ("rejected", str(e), done)
                except Exception:  # noqa: BLE001 - vLLM (or the instrumentation) raised
                    d.sched = None  # its state is unknown now: reset() before more events
                    reply = ("crash", traceback.format_exc(), done)
                if reply is not None:
                    break
            send(out, reply or ("ok", done))
        else:
            send(out, ("crash", f"unknown request {op!r}"))


if __name__ == "__main__":
    sys.exit(main())
