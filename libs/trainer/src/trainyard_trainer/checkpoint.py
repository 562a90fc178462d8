"""Moved to :mod:`trainyard.checkpoint` (the rank SDK, which the trainer uses); this name stays so that
existing imports (and monkeypatches) of ``trainyard_trainer.checkpoint`` reach the same module."""

import sys

import trainyard.checkpoint as _moved

sys.modules[__name__] = _moved
