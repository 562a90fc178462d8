"""trainyard: the rank SDK. A training script run by trainyard (or on a laptop, in local mode)::

    import trainyard

    with trainyard.init() as run:
        model, opt = build(run.device)
        loader = run.data_loader()
        state = {"model": trainyard.ModelState(model), "optim": trainyard.OptimizerState(model, opt),
                 "loader": loader}
        step = run.restore(state)                  # 0 when the job starts fresh
        while step < run.max_steps:
            with run.timing.data():
                micro_batches = next(loader)
            with run.timing.compute():
                loss = train_step(model, opt, micro_batches)
            step += 1
            run.report(step, loss=loss)
            run.checkpoint(step, state)            # every step, every rank: the policy decides
            if run.should_stop():                  # pause / preemption, saved: exit 7, resumed later
                break

See docs/sdk.md for what each call guarantees.
"""

from torch import OutOfMemoryError

from trainyard_contract.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigError,
    DataError,
    NonFiniteError,
    TrainyardError,
)

from trainyard.checkpoint import NoVerifiedCheckpointError, SavedShard
from trainyard.environment import NotInTrainyard, local_settings
from trainyard.exits import exit_code_for
from trainyard.loader import DataLoader
from trainyard.preemption import StoppedOnRequest
from trainyard.run import Run, init
from trainyard.settings import RankSettings
from trainyard.state import ModelState, OptimizerState, Progress, RngState
from trainyard.timing import StepTimes, Timing

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DataLoader",
    "ModelState",
    "NoVerifiedCheckpointError",
    "NonFiniteError",
    "NotInTrainyard",
    "OptimizerState",
    "OutOfMemoryError",
    "Progress",
    "RankSettings",
    "RngState",
    "Run",
    "SavedShard",
    "StepTimes",
    "StoppedOnRequest",
    "Timing",
    "TrainyardError",
    "exit_code_for",
    "init",
    "local_settings",
]
