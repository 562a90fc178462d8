"""Moved to :mod:`trainyard.metrics` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.metrics`` reach the same module."""

import sys

import trainyard.metrics as _moved

sys.modules[__name__] = _moved
