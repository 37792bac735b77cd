"""A fleet of simulated engines behind a router, on one virtual clock.

Each replica is the real engine loop (engine/engine_core.py) with the real scheduler and
block pool, and a simulated executor (sim/executor.py) that prices steps with a cost
model. The fleet is a discrete-event simulation: the next event is an arrival (routed by
replicas/router.py on the loads of that moment) or the step of the replica furthest behind.

A replica can fail and come back (sim/outages.py): its requests that had made a token are
lost, the others go to the other replicas, and it returns `down` seconds later, fresh.

Two things make a million requests affordable without changing a single decision:
steady decodes advance together inside the scheduler (sim/decode_cohort.py), and a
replica whose next steps are only those decodes "glides": it prices them ahead and runs
them all at once, as far as an arrival lets it (tests/sim/test_fleet.py checks both give the
same records as stepping every request, `--step-by-step`). What depends on a request's
tokens alone, the names of its KV blocks and the router's reading of its prompt, is
worked out ahead on another core (sim/block_hash_feed.py).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from iterserve.bench.records import RequestRecord
from iterserve.bench.workloads import Workload
from iterserve.config import EngineConfig, resolve_async_scheduling
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler
from iterserve.engine.kv_pool_size import AvailableMemory, num_kv_blocks, size_kv_pool
from iterserve.replicas.router import (
    NoReplicaError,
    ReplicaLoad,
    ReplicaLoadTracker,
    Router,
    make_router,
)
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.sim.block_hash_feed import BlockHashFeed
from iterserve.sim.cohort_scheduler import CohortScheduler, steady_part
from iterserve.sim.cost_profile import CostProfile, ProfiledCostModel
from iterserve.sim.engine import SteadyEngineCore
from iterserve.sim.executor import (
    HARDWARE,
    MODELS,
    CostModel,
    RooflineCostModel,
    SimulatedExecutor,
    VirtualClock,
)
from iterserve.sim.outages import WAIT_FOR_REPLICA, OutageReport, ReplicaOutage

# Share of the accelerator's memory left to weights + KV cache (the rest: activations).
_MEMORY_UTILIZATION = 0.9


# The context a simulated request may reach without --max-model-len: long enough for any
# trace's request (the presets do not say their models' context lengths).
_MAX_MODEL_LEN = 131072


def max_model_len(config: EngineConfig) -> int:
    return config.scheduler.max_model_len or _MAX_MODEL_LEN


def kv_blocks_for(config: EngineConfig, hardware: str, model: str) -> int:
    """Blocks that fit beside the weights in the device's memory, or, for a preset sized as
    iterserve's engine sizes its pool, what `iterserve serve` would take on that machine; the
    config's exact count if it names one."""
    hw = HARDWARE[hardware]
    shape = MODELS[model].with_kv_cache_dtype(config.cache.kv_cache_dtype)
    if hw.kv_cache_from_config:
        # The engine's rule (engine/kv_pool_size.py): --kv-cache-memory GiB as given, or
        # auto's share of what the preset's machine would have available once the weights
        # are loaded and nothing else runs: its memory less theirs.
        def available() -> AvailableMemory:
            left = int(hw.memory_bytes - shape.weight_bytes)
            return AvailableMemory(left, f"{hardware}'s memory less the weights")

        num_blocks = size_kv_pool(
            config.cache,
            shape.kv_bytes_per_token,
            config.scheduler.max_num_seqs,
            max_model_len(config),
            available,
        ).num_blocks
    else:
        free = hw.memory_bytes * _MEMORY_UTILIZATION - shape.weight_bytes
        num_blocks = num_kv_blocks(config.cache, shape.kv_bytes_per_token, free)
    if num_blocks < 1:
        raise ValueError(f"{model} does not fit in {hardware}'s memory")
    return num_blocks


# Most steps a replica glides over at once: bounds the prices computed ahead, which are
# thrown away when a request arrives first (after ~7 steps on the million-request fleet of
# docs/simulator.md). Longer limits price more steps for nothing: 8 replays the fleet
# faster than 16 (`benchmarks/fleet_replay.py --baseline REV` times two limits side by side).
_GLIDE_LIMIT = 8


class FleetLoadTracker(ReplicaLoadTracker):
    """The front end's load tracking, plus tokens the cohort makes in aggregate."""

    __slots__ = ()

    def made(self, num_tokens: int) -> None:
        """Output tokens counted in aggregate, not per request (the cohort's decodes); each
        request's `unmade` at its finish must then count them as made."""
        self.outstanding -= num_tokens

    def load_after(self, num_made: int, num_finished: int) -> ReplicaLoad:
        """The load once `num_made` more tokens are counted by made() and `num_finished`
        requests have finished with all their tokens made: what a gliding replica's
        tracker will hold when it lands, read before."""
        return ReplicaLoad(self.outstanding - num_made, len(self.work) - num_finished)


@dataclass
class Glide:
    """Steps a replica will run if no request reaches it first, priced ahead: only its
    steady decodes run in them (CohortScheduler.steady_outlook), so nothing but an arrival can
    change them. The fleet runs them lazily, all at once, up to the moment it must."""

    costs: list[float]
    ends: list[float]  # the clock after each step
    starts: list[float]
    tracker: FleetLoadTracker  # the replica's, unchanged until the glide lands
    made: list[int]  # tokens made in the first i steps, for i up to all
    finished: list[int]  # requests finished in the first i steps

    def steps_started_before(self, when: float) -> int:
        return bisect.bisect_left(self.starts, when)

    def load_after(self, num_steps: int) -> ReplicaLoad:
        """The replica's load once its first `num_steps` steps have run."""
        return self.tracker.load_after(self.made[num_steps], self.finished[num_steps])


@dataclass
class Replica:
    """One simulated engine of a fleet: its own clock, cost model, scheduler and KV pool."""

    clock: VirtualClock
    executor: SimulatedExecutor
    engine: SteadyEngineCore
    # The load a router sees, kept as the data-parallel front end keeps its replicas'.
    tracker: FleetLoadTracker = field(default_factory=FleetLoadTracker)
    # After a failure (sim/outages.py): the replica's outages so far, and the engines it
    # ran before them (this one is the latest, fresh from its last restart).
    outages: list[OutageReport] = field(default_factory=list)
    earlier: list[Replica] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        hardware: str,
        model: str,
        acceptance_rate: float,
        seed: int,
        profile: CostProfile | None = None,
        num_kv_blocks: int | None = None,
        step_by_step: bool = False,
    ) -> Replica:
        """A replica priced by `profile` if given, else by the roofline model of `hardware`
        and `model`; with `num_kv_blocks` blocks, else what fits beside the weights.
        Steady decodes advance together (sim/decode_cohort.py) unless `step_by_step`."""
        clock = VirtualClock()
        cost: CostModel = (
            ProfiledCostModel(profile)
            if profile is not None
            else RooflineCostModel(
                HARDWARE[hardware],
                MODELS[model].with_kv_cache_dtype(config.cache.kv_cache_dtype),
                resolve_async_scheduling(config, HARDWARE[hardware].device_type)[0],
            )
        )
        executor = SimulatedExecutor(cost, clock, acceptance_rate, seed)
        engine = SteadyEngineCore.build(
            config,
            executor,
            num_kv_blocks or kv_blocks_for(config, hardware, model),
            max_model_len(config),
            clock,
        )
        if not step_by_step:
            engine.scheduler.advance_decodes_together(executor.PLACEHOLDER_TOKEN)
        return cls(clock, executor, engine)

    @property
    def scheduler(self) -> CohortScheduler:
        return self.engine.scheduler

    def load(self) -> ReplicaLoad:
        return self.tracker.load()

    def plan_glide(self) -> Glide | None:
        steps = self.scheduler.steady_outlook(_GLIDE_LIMIT)
        if len(steps) < 2:
            return None
        costs = list(map(self.executor.cost_model.steady_step_time, steps))
        # Added up one by one as SimulatedExecutor.execute adds, to the last bit.
        clock = list(accumulate(costs, initial=self.clock.now))
        made = list(accumulate((step.num_seqs for step in steps), initial=0))
        finished = list(accumulate((step.num_last for step in steps), initial=0))
        return Glide(costs, clock[1:], clock[:-1], self.tracker, made, finished)

    def land(
        self,
        glide: Glide,
        num_steps: int,
        requests: dict[str, Request],
        records: dict[str, RequestRecord],
    ) -> None:
        """Run the glide's first `num_steps` steps; the requests they finish leave
        `requests` for their entries in `records`."""
        if not num_steps:
            return
        for cost in glide.costs[:num_steps]:
            self.executor.busy_time += cost
        self.clock.now = glide.ends[num_steps - 1]
        finished = self.engine.run_steady(glide.made[num_steps], glide.ends[:num_steps])
        self.tracker.made(glide.made[num_steps])
        for request in finished:  # their tokens were counted as made
            self.progress(request, 0, True)
            _record(records[request.request_id], requests.pop(request.request_id))

    def step(
        self,
        requests: dict[str, Request],
        records: dict[str, RequestRecord],
        no_more_arrivals: bool,
    ) -> bool:
        """One engine step by the book; whether it did any work. A request it finishes
        leaves `requests` for its entry in `records`."""
        step = self.engine.step(no_more_arrivals)
        if not step.did_work:
            return False
        steady = steady_part(step.scheduled)
        if steady is not None:
            self.tracker.made(steady.num_seqs)
        for update in step.updates:
            request = requests[update.request_id]
            self.progress(request, len(update.new_token_ids), update.finished)
            if update.finished:
                _record(records[update.request_id], requests.pop(update.request_id))
        return True

    def progress(self, request: Request, new_tokens: int, finished: bool) -> None:
        self.tracker.progress(request.request_id, new_tokens)
        if finished:  # what it will not make after all (glided tokens count as made)
            unmade = request.sampling_params.max_tokens - request.num_output_tokens
            self.tracker.finish(request.request_id, unmade)


def simulate_fleet(
    config: EngineConfig,
    workload: Workload,
    offsets: list[float],
    hardware: str,
    model: str,
    acceptance_rate: float = 0.0,
    replicas: int = 1,
    router: str = "round-robin",
    profile: CostProfile | None = None,
    num_kv_blocks: int | None = None,
    step_by_step: bool = False,
    outages: list[ReplicaOutage] | None = None,
) -> tuple[list[RequestRecord], list[Replica]]:
    """Replay the workload on `replicas` engines behind a router (replicas/router.py).

    Discrete events in virtual time: the next thing to happen is either the next arrival
    (routed on the replicas' loads at that moment) or a step of the busy replica furthest
    behind, whose clock then moves on by the step's cost, or a replica's failure or
    return (`outages`; what each did is in the replica's `outages`). Replicas run side by
    side; an idle one waits for its next request. One replica makes exactly the decisions
    of a single engine. `step_by_step`: no steady decodes advanced together (the same
    results, slower; for checking that they are the same)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    ReplicaOutage.check(outages or [], replicas)
    # The replay keeps millions of objects alive (token times, blocks, requests) that the
    # cycle collector would walk again and again, and makes no cycles worth collecting: the
    # collector is off while it runs (benchmarks/fleet_replay.py times the replay).
    collecting = gc.isenabled()
    gc.disable()
    # Arrival order; requests arriving together, the later listed first.
    order = sorted(reversed(range(len(offsets))), key=offsets.__getitem__)
    routing = make_router(router, config.cache.block_size, config.seed)
    feed = None
    if BlockHashFeed.wanted(config.cache, len(order)):
        token = SimulatedExecutor.PLACEHOLDER_TOKEN
        feed = BlockHashFeed(
            workload.requests, order, config.cache.block_size, token,
            lambda prompt: routing.prepare(prompt, replicas),
        )  # fmt: skip

    def build(i: int) -> Replica:  # replica i, first or after a failure: the same settings
        return Replica.build(
            config, hardware, model, acceptance_rate, config.seed + i, profile, num_kv_blocks,
            step_by_step,
        )  # fmt: skip

    try:
        fleet = [build(i) for i in range(replicas)]
        replay = FleetReplay(
            config, workload, offsets, order, fleet, routing, feed, step_by_step, outages, build
        )
        return replay.run(), replay.fleet
    finally:
        if feed is not None:
            feed.close()
        if collecting:
            gc.enable()


class FleetReplay:
    """The discrete-event loop of simulate_fleet over replicas already built, and what it
    keeps between events: which replica is busy until when, which glide, and the loads
    the router reads."""

    def __init__(
        self,
        config: EngineConfig,
        workload: Workload,
        offsets: list[float],
        order: list[int],
        fleet: list[Replica],
        routing: Router,
        feed: BlockHashFeed | None,
        step_by_step: bool = False,
        outages: list[ReplicaOutage] | None = None,
        rebuild: Callable[[int], Replica] | None = None,
    ) -> None:
        self.workload, self.offsets, self.fleet = workload, offsets, fleet
        self.step_by_step = step_by_step  # no glides either (to check they change nothing)
        self.routing, self.feed = routing, feed
        self.records = [
            RequestRecord(f"sim-{i}", r.prompt_len, r.output_len, r.lane, offsets[i], offsets[i])
            for i, r in enumerate(workload.requests)
        ]
        self.by_id = {record.request_id: record for record in self.records}
        self.requests: dict[str, Request] = {}  # the ones a scheduler took, until they finish
        self.arrivals = order[::-1]  # popped from the end: the first arrival last
        # Busy replicas by the time their next step starts, or their glide ends (ties: the
        # lower index first), with the version of their plan (a glide cut short leaves its
        # entry behind, outdated).
        self.busy: list[tuple[float, int, int]] = []
        self.versions = [0] * len(fleet)
        self.glides: dict[int, Glide] = {}
        # Gliding replicas by when their next glided step starts: an arrival after that
        # sees their load lower (tagged like `busy`).
        self.glide_steps: list[tuple[float, int, int]] = []
        self.loads = [replica.load() for replica in fleet]  # renewed as each one's changes
        self.wait = config.scheduler.max_wait_ms / 1000
        self.params: dict[int, SamplingParams] = {}  # by max_tokens (see _params_for)
        # Failures, and returns once a failure has landed, by time (ties: in the order
        # given); and requests waiting while no replica is up.
        self.events: list[tuple[float, int, bool, OutageReport]] = [
            (outage.at, order, True, OutageReport(outage))
            for order, outage in enumerate(outages or [])
        ]
        heapq.heapify(self.events)
        self.rebuild = rebuild
        self.waiting: list[_Waiting] = []
        self.last_failure: OutageReport | None = None  # whose outage a waiting one counts in

    def run(self) -> list[RequestRecord]:
        """Events until every request is done: the next arrival, or else the step of the
        replica furthest behind."""
        arrivals, busy, offsets, events = self.arrivals, self.busy, self.offsets, self.events
        while arrivals or busy or self.waiting:
            next_arrival = offsets[arrivals[-1]] if arrivals else math.inf
            if events and events[0][0] <= next_arrival and (not busy or events[0][0] <= busy[0][0]):
                self._outage_event(*heapq.heappop(events))
            elif not busy or next_arrival <= busy[0][0]:
                self._arrive(arrivals.pop(), next_arrival)
            else:
                self._step(*heapq.heappop(busy), next_arrival)
        if offsets:  # idle replicas waited out the arrivals
            for replica in self.fleet:
                replica.clock.advance_to(max(offsets))
        return self.records

    def _arrive(self, i: int, now: float) -> None:
        """Request i arrives: routed on the loads of this moment."""
        self._glide_until(now)
        wanted = self.workload.requests[i]
        prompt = wanted.token_ids()
        if self.feed is not None:
            hashes, prepared, later_members = self.feed.next()
        else:
            hashes, prepared, later_members = (
                [],
                self.routing.prepare(prompt, len(self.fleet)),
                False,
            )
        params = self._params_for(wanted.output_len)
        self._place(
            _Waiting(now, self.records[i], prompt, hashes, prepared, later_members, params, wanted.lane),
            now,
        )  # fmt: skip

    def _place(self, what: _Waiting, now: float) -> None:
        """Route a request to a replica that first runs what it glided over by now; while
        no replica is up, it waits for one."""
        try:
            index = self.routing.choose(what.prepared, self.loads)
        except NoReplicaError:
            self.waiting.append(what)
            if self.last_failure is not None:
                self.last_failure.waited += 1
            return
        target = self.fleet[index]
        if index in self.glides:  # it glides no further: run what it did by now
            glide = self.glides.pop(index)
            target.land(glide, glide.steps_started_before(now), self.requests, self.by_id)
            self.versions[index] += 1
            if target.engine.has_unfinished():  # else it finished them all: idle
                heapq.heappush(self.busy, (target.clock.now, index, self.versions[index]))
        was_idle = not target.engine.has_unfinished()
        request = _admit(
            target.scheduler, what.prompt, what.hashes, what.params, what.lane, what.record
        )
        if request is None:
            return
        if self.feed is not None:  # its chain is known: see sim/replay_pool.py
            target.scheduler.admit_to_group(request, what.later_members)
        self.requests[request.request_id] = request
        target.tracker.take(request.request_id, len(what.prompt), what.params.max_tokens)
        self.loads[index] = target.load()
        if was_idle:
            target.clock.advance_to(now)
            heapq.heappush(self.busy, (target.clock.now, index, self.versions[index]))

    def _outage_event(self, now: float, order: int, failing: bool, report: OutageReport) -> None:
        index = report.outage.replica
        if failing:
            self._fail(index, now, order, report)
        else:
            self._restore(index, now, report)

    def _fail(self, index: int, now: float, order: int, report: OutageReport) -> None:
        """Replica `index` fails: at the end of the step it is in (a step is atomic here).
        What had produced a token is lost; what had not goes to the other replicas."""
        replica = self.fleet[index]
        glide = self.glides.get(index)
        ends = replica.clock.now  # a busy replica's clock: when its step in progress ends
        if glide is not None:
            started = glide.steps_started_before(now)
            ends = glide.ends[started - 1] if started else glide.starts[0]
        if ends > now and replica.engine.has_unfinished():  # mid-step: fail when it ends
            heapq.heappush(self.events, (ends, order, True, report))
            return
        self._glide_until(now)
        if glide is not None:
            del self.glides[index]
            replica.land(glide, glide.steps_started_before(now), self.requests, self.by_id)
        self.versions[index] += 1  # its plans are void
        self.routing.set_available(index, False)
        self.last_failure = report
        report.landed = now
        replica.outages.append(report)
        heapq.heappush(self.events, (now + report.outage.down, order, False, report))
        orphans = []
        for request_id in list(replica.tracker.work):
            request = self.requests.pop(request_id)
            record = self.by_id[request_id]
            if request.timings.first_token is not None:
                report.lost += 1
                record.error = f"replica {index} failed after the request's first token"
            else:
                report.rerouted += 1
                orphans.append((record.arrival_time, request_id, record, request))
        for _, _, record, request in sorted(orphans, key=lambda o: o[:2]):
            prompt = request.prompt_token_ids
            hashes = request.block_hashes if self.feed is not None else []
            prepared = self.routing.prepare(prompt, len(self.fleet))
            # Later members of its prefix group may come: the cautious answer for the pool.
            waiting = _Waiting(
                now, record, prompt, hashes, prepared, True, request.sampling_params, request.lane
            )
            self._place(waiting, now)

    def _restore(self, index: int, now: float, report: OutageReport) -> None:
        """Replica `index` serves again: a fresh engine, empty cache; those waiting for a
        replica go to one (or fail, if they waited longer than the front end waits)."""
        assert self.rebuild is not None, "a fleet with outages is built by simulate_fleet"
        old = self.fleet[index]
        replica = self.fleet[index] = self.rebuild(index)
        replica.clock.advance_to(now)
        replica.outages, replica.earlier = old.outages, [*old.earlier, old]
        old.outages = []
        self.loads[index] = replica.load()
        self.versions[index] += 1
        self.routing.set_available(index, True)
        waiting, self.waiting = self.waiting, []
        for what in waiting:
            if now - what.since > WAIT_FOR_REPLICA:
                what.record.error = f"no replica came back within {WAIT_FOR_REPLICA:.0f} s"
                if self.last_failure is not None:
                    self.last_failure.timed_out += 1
            else:
                self._place(what, now)

    def _params_for(self, output_len: int) -> SamplingParams:
        """One SamplingParams per output length, shared by the requests that have it (the
        scheduler only reads them; validating one a request cost a million-request replay
        ~1%)."""
        params = self.params.get(output_len)
        if params is None:
            params = self.params[output_len] = SamplingParams(
                max_tokens=output_len, ignore_eos=True
            )
        return params

    def _glide_until(self, now: float) -> None:
        """The loads of gliding replicas as of `now`: their steps that started before."""
        glide_steps = self.glide_steps
        while glide_steps and glide_steps[0][0] < now:
            _, index, version = heapq.heappop(glide_steps)
            if version != self.versions[index] or index not in self.glides:
                continue
            glide = self.glides[index]
            done = glide.steps_started_before(now)
            self.loads[index] = glide.load_after(done)
            if done < len(glide.starts):
                heapq.heappush(glide_steps, (glide.starts[done], index, version))

    def _step(self, _: float, index: int, version: int, next_arrival: float) -> None:
        """The replica furthest behind runs its glide to the end, or one step by the book
        (or waits for the next arrival), then plans what it does next."""
        if version != self.versions[index]:
            return
        replica = self.fleet[index]
        if index in self.glides:  # glided all the way (it may glide on)
            glide = self.glides.pop(index)
            replica.land(glide, len(glide.ends), self.requests, self.by_id)
            self.loads[index] = replica.load()
        elif replica.step(self.requests, self.by_id, not self.arrivals):
            self.loads[index] = replica.load()
        else:  # nothing runnable: on to the next arrival (or let a dynamic batch wait)
            wait = self.wait
            candidates = [t for t in (next_arrival, wait and replica.clock.now + wait) if t]
            if not candidates or min(candidates) == math.inf:
                raise RuntimeError("the simulated scheduler is stuck with nothing to run")
            replica.clock.advance_to(min(candidates))
        if replica.engine.has_unfinished():
            self._plan(index, replica, version)

    def _plan(self, index: int, replica: Replica, version: int) -> None:
        """Its next step by the book, or a glide over the steps only its steady decodes run."""
        glide = None if self.step_by_step else replica.plan_glide()
        if glide is None:
            heapq.heappush(self.busy, (replica.clock.now, index, version))
        else:
            self.glides[index] = glide
            heapq.heappush(self.busy, (glide.ends[-1], index, version))
            heapq.heappush(self.glide_steps, (glide.starts[0], index, version))


class _Waiting(NamedTuple):
    """A request on its way to a replica: arriving, re-routed, or waiting for one to be up."""

    since: float
    record: RequestRecord
    prompt: list[int]
    hashes: list[int]
    prepared: object  # the router's reading of the prompt
    later_members: bool  # of its prefix group (sim/replay_pool.py)
    params: SamplingParams
    lane: str


def _admit(
    scheduler: Scheduler,
    prompt: list[int],
    block_hashes: list[int],
    params: SamplingParams,
    lane: str,
    record: RequestRecord,
) -> Request | None:
    request = Request(
        record.request_id,
        prompt,
        params,
        record.arrival_time,
        lane=lane,
        block_hashes=block_hashes,  # type: ignore[arg-type]
    )
    try:
        scheduler.add_request(request)
    except InvalidRequestError as err:
        record.error = str(err)
        return None
    return request


def _record(record: RequestRecord, request: Request) -> None:
    t = request.timings
    record.first_scheduled_time = t.first_scheduled
    record.first_token_time = t.first_token
    record.token_times = t.token_times  # the request is done with them
    record.finish_time = t.finished
    record.output_len = request.num_output_tokens
    record.num_cached_tokens = request.num_cached_tokens
    record.success = True
