"""Moved to :mod:`trainyard.settings` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.settings`` reach the same module."""

import sys

import trainyard.settings as _moved

sys.modules[__name__] = _moved
