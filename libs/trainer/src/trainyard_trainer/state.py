"""Moved to :mod:`trainyard.state` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.state`` reach the same module."""

import sys

import trainyard.state as _moved

sys.modules[__name__] = _moved
