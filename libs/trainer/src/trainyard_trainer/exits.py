"""Moved to :mod:`trainyard.exits` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.exits`` reach the same module."""

import sys

import trainyard.exits as _moved

sys.modules[__name__] = _moved
