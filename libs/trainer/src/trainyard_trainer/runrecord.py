"""Moved to :mod:`trainyard.runrecord` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.runrecord`` reach the same module."""

import sys

import trainyard.runrecord as _moved

sys.modules[__name__] = _moved
