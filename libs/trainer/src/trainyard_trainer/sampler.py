"""Moved to :mod:`trainyard.sampler` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.sampler`` reach the same module."""

import sys

import trainyard.sampler as _moved

sys.modules[__name__] = _moved
