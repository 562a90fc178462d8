"""Pipeline bubbles: how much of a step the pipeline stages spend idle.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2): with ``p`` stages and ``m`` micro-batches per step, GPipe and 1F1B both idle
for ``(p - 1)`` micro-batch slots at the start and end, a bubble of ``(p - 1) / m`` of the ideal
compute time; the interleaved schedule with ``v`` model chunks per device cuts it to
``(p - 1) / (v m)``. 1F1B differs from GPipe in memory, not in bubble: it holds at most ``p``
micro-batches of activations instead of all ``m``.
"""

from __future__ import annotations

from trainyard_planner.layout import Layout, Schedule


def bubble_ratio(schedule: Schedule | str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time divided by ideal compute time: ``(p-1)/m``, or ``(p-1)/(v m)`` interleaved."""
    schedule = Schedule(schedule)
    _check(stages, microbatches, virtual_stages)
    v = virtual_stages if schedule is Schedule.INTERLEAVED else 1
    return (stages - 1) / (v * microbatches)


def bubble_fraction(schedule: Schedule | str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The share of the whole step that is bubble: ``ratio / (1 + ratio)``."""
    ratio = bubble_ratio(schedule, stages, microbatches, virtual_stages)
    return ratio / (1 + ratio)


def layout_bubble_ratio(layout: Layout) -> float:
    """:func:`bubble_ratio` of a layout's pipeline."""
    return bubble_ratio(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)


def inflight_microbatches(schedule: Schedule | str, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations the first stage holds at its peak.

    GPipe runs every forward before any backward (all ``m``); 1F1B and interleaved start a
    backward once the pipeline is full (at most ``p``).
    """
    _check(stages, microbatches, 1)
    if Schedule(schedule) is Schedule.GPIPE:
        return microbatches
    return min(stages, microbatches)


def _check(stages: int, microbatches: int, virtual_stages: int) -> None:
    if stages < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"stages ({stages}), microbatches ({microbatches}) and virtual stages ({virtual_stages}) "
            "must all be at least 1"
        )
