"""Property 7's liveness half: a ``Drain`` event, run the way vLLM's engine
runs (``EngineCore.step_with_batch_queue``).

With no new requests and no failures, the engine schedules while its batch
queue has room and otherwise takes the oldest output (here every draft is
accepted), until no request is left. Every request must finish within

    2 * depth * (1 + N * T)   scheduler iterations (Schedule or Process events)

for ``N`` live requests holding ``T`` tokens of prompt plus outputs in all:
each request needs at most its own tokens computed, and recomputes from
scratch at most once per request ahead of it, since the scheduler preempts
the lowest-priority running request; a token costs at most ``2 * depth``
iterations (pipeline parallelism decodes a request every ``depth - 1``
iterations, and each step's output is taken once). Judged only when each live request fits
in the pool alone, as vLLM's startup check demands for ``max_model_len``; a
pool too small for one request can only wait.

The machine (properties/machine.py) and ``replay`` both expand a Drain here,
so a trace that ends in a Drain replays to the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable

from model.events import AddRequest, Config, Event, Process, Schedule
from model.observations import Counters, Observed, StepObs
from properties.invariants import Checker, Violation


def drain_limit(cfg: Config, reqs: dict[str, AddRequest], live: list[str]) -> int:
    tokens = sum(reqs[r].prompt_len + reqs[r].max_new_tokens for r in live)
    return 2 * cfg.depth * (1 + len(live) * tokens)


def fits_alone(cfg: Config, req: AddRequest, counters: Counters | None, reserved: int) -> bool:
    """Whether the pool holds ``req`` with nothing else running: its whole
    sequence (and draft slots) per group, capped by the group's admission
    bound where the target reports one."""
    spec = cfg.spec_tokens
    bound = counters.bound if counters is not None and counters.bound else ()
    need = 0
    for gi, g in enumerate(cfg.groups):
        B = cfg.group_block_size(gi)
        n = -(-(req.prompt_len + req.max_new_tokens + spec) // B)
        n += g.spec.speculative_blocks(spec)
        if not g.spec.reads_positions:  # a ring, the encoder's outputs: a fixed count
            n = g.spec.live_bound(B, cfg.max_model_len, 0)
        if gi < len(bound):
            n = min(n, bound[gi] + spec)
        need += n
    return need <= cfg.num_blocks - 1 - reserved


def drain(cfg: Config, checker: Checker, counters: Counters | None,
          reqs: dict[str, AddRequest], live: Callable[[], list[str]],
          apply: Callable[[Event], Observed], event_index: int,
          can: Callable[[Event], bool] | None = None) -> Violation | None:
    """Run the engine loop through ``apply`` until ``live()`` is empty; the
    property-7 violation if it is not within the limit (None: finished, or not
    judged because a request cannot fit alone). ``can``: whether the target's
    loop takes an event now (SGLang's overlap loop processes the batch in
    flight right after an iteration that scheduled nothing)."""
    rids = live()
    if not rids:
        return None
    if not all(fits_alone(cfg, reqs[r], counters, len(checker.reserved)) for r in rids):
        return None
    limit = drain_limit(cfg, reqs, rids)
    idle = 0  # empty schedules in a row with only empty steps in flight
    for _ in range(limit):
        if not checker.live_requests():
            checker.witness["drained"] += 1
            return None
        if checker.in_flight_steps() < cfg.depth and (can is None or can(Schedule())):
            busy = checker.busy_steps()
            obs = apply(Schedule())
            steps = [it for it in obs.items if isinstance(it, StepObs)]
            if any(it.reqs for it in steps):
                idle = 0
                continue  # the engine schedules again while the queue has room
            if not busy:
                idle += 1
                if idle > cfg.depth:  # pipeline parallelism staggers decodes, no more
                    return Violation(7, f"nothing is in flight and schedule() scheduled "
                                        f"nothing {idle} times in a row, while "
                                        f"{', '.join(live())} have not finished",
                                     event_index=event_index,
                                     facts={"fact": "stalls", "rids": live(), "idle": idle})
                if not checker.in_flight_steps():
                    continue  # (SGLang's loop queues no empty step)
            if steps and checker.in_flight_steps() < cfg.depth:
                continue  # vLLM's engine queued the empty step and schedules again
        apply(Process())
    if not live():
        checker.witness["drained"] += 1
        return None
    return Violation(7, f"with no new requests and no failures, {', '.join(live())} did not "
                        f"finish within {limit} scheduler iterations (2 * depth * (1 + requests "
                        f"* tokens))", event_index=event_index)
