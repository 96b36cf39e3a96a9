"""Which GPU each worker actor sits on, asked once per actor.

An actor keeps its device for life, so the answer is cached by actor id in the flow's process: a weight
sync or a colocated hand-over then costs no round trip to learn placement, and a replaced worker (a new
actor, a new id) is asked again. On CPU every answer is None, and the hand-over skips the actors.
"""

from __future__ import annotations

from typing import Sequence

import ray
from ray.actor import ActorHandle

_KNOWN: dict[str, str | None] = {}


def gpus_of(actors: Sequence[ActorHandle], timeout_s: float) -> list[str | None]:
    """Each actor's ``gpu_identity()`` (None on CPU), in order; only unknown actors are asked."""
    keys = [actor._actor_id.hex() for actor in actors]  # Ray has no public accessor for an actor's id
    unknown = [(key, actor) for key, actor in zip(keys, actors) if key not in _KNOWN]
    if unknown:
        answers = ray.get([actor.gpu_identity.remote() for _, actor in unknown], timeout=timeout_s)
        _KNOWN.update((key, answer) for (key, _), answer in zip(unknown, answers))
    return [_KNOWN[key] for key in keys]


def on_gpus(actors: Sequence[ActorHandle], timeout_s: float) -> list[ActorHandle]:
    """The actors that hold a GPU: only they have memory to hand over."""
    return [actor for actor, gpu in zip(actors, gpus_of(actors, timeout_s)) if gpu is not None]
