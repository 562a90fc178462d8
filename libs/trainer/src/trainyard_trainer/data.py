"""Moved to :mod:`trainyard.data` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.data`` reach the same module."""

import sys

import trainyard.data as _moved

sys.modules[__name__] = _moved
