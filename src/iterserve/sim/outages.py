"""Replica failures in a simulated fleet: when a replica goes down, for how long, and what
it cost (`iterserve simulate --replicas N --replica-failures t=30,replica=3,down=20`).

The model follows the data-parallel front end (replicas/data_parallel.py): at the failure
the replica's requests that had produced a token are lost (the client got an error), those
that had not are sent at once to the other replicas (keeping their arrival time, so their
latency counts the detour), and the router leaves the replica out. `down` seconds later it
serves again, a fresh engine with an empty prefix cache (`down` stands for the front end's
noticing, its back-off, the new process, the model's load and warm-up). While no replica is up, arrivals
wait for one, as long as the front end would (`WAIT_FOR_REPLICA`), and then fail.

A simulated step is atomic: a failure lands when the step the replica is in ends (at most
one step after `t`), and the tokens of that step stand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The data-parallel front end's bound on waiting for a replica when none serves.
WAIT_FOR_REPLICA = 60.0

_SPEC = re.compile(r"\s*t=([0-9.]+)\s*,\s*replica=(\d+)\s*,\s*down=([0-9.]+)\s*")


@dataclass(frozen=True)
class ReplicaOutage:
    at: float  # virtual seconds after the run's start
    replica: int
    down: float  # seconds from the failure landing until it serves again

    @classmethod
    def parse(cls, text: str) -> ReplicaOutage:
        """ "t=30,replica=3,down=20": replica 3 fails 30 s in, serves again at 50 s."""
        match = _SPEC.fullmatch(text)
        if match is None:
            raise ValueError(
                f"replica failure {text!r} is not t=SECONDS,replica=INDEX,down=SECONDS "
                "(e.g. t=30,replica=3,down=20)"
            )
        return cls(float(match.group(1)), int(match.group(2)), float(match.group(3)))

    @staticmethod
    def check(outages: list[ReplicaOutage], replicas: int) -> None:
        """Refuse a replica the fleet has not, or one failing again while still down."""
        for outage in outages:
            if outage.replica >= replicas:
                raise ValueError(
                    f"replica failure names replica {outage.replica}, but the fleet has "
                    f"{replicas} (0..{replicas - 1})"
                )
        for replica in {o.replica for o in outages}:
            own = sorted((o for o in outages if o.replica == replica), key=lambda o: o.at)
            for first, second in zip(own, own[1:], strict=False):
                if second.at < first.at + first.down:
                    raise ValueError(
                        f"replica {replica} fails at {second.at:g} s while down since "
                        f"{first.at:g} s (for {first.down:g} s)"
                    )


@dataclass
class OutageReport:
    """What one outage did."""

    outage: ReplicaOutage
    landed: float | None = None  # when it took effect (the end of the step then running)
    lost: int = 0  # requests that had produced tokens: failed
    rerouted: int = 0  # requests taken, no token yet: sent to another replica
    waited: int = 0  # arrivals (and re-routed ones) that found no replica up and waited
    timed_out: int = 0  # of those, failed after WAIT_FOR_REPLICA with no replica back

    def describe(self) -> str:
        o = self.outage
        if self.landed is None:
            return f"replica {o.replica}'s failure at {o.at:g}s came after the last request"
        return (
            f"replica {o.replica} down at {self.landed:.1f}s for {o.down:g}s: {self.lost} "
            f"requests lost (had produced tokens), {self.rerouted} re-routed (had not)"
            + (f", {self.waited} waited for a replica" if self.waited else "")
            + (f", {self.timed_out} of them in vain" if self.timed_out else "")
        )
