"""Moved to :mod:`trainyard.runtime` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.runtime`` reach the same module."""

import sys

import trainyard.runtime as _moved

sys.modules[__name__] = _moved
