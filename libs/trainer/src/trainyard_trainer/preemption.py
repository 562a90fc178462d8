"""Moved to :mod:`trainyard.preemption` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.preemption`` reach the same module."""

import sys

import trainyard.preemption as _moved

sys.modules[__name__] = _moved
