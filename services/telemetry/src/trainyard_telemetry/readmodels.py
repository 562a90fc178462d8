"""The read models as the API (and the checkpoint coordinator) read them: key layouts and readers, importable
without consuming a stream.

The telemetry service is the one writer of these keys (:mod:`.ingest`, and the refresh loops of
:mod:`.service`); a reader builds the same classes over its own Redis client and calls only their read
methods, which touch no consumer, no loop and no Prometheus series:

==============================  ==========================================  ================================
read model                      keys (``trainyard_runtime.store.Keys``)     reader
==============================  ==========================================  ================================
step timing (rank 0, per rank)  ``attempt_steps``, ``attempt_step_points``,  :class:`StepTimingStore` ``timings``,
                                ``rank_timing``, ``stragglers``              ``ranks``, ``stragglers``
progress                        ``progress``                                 ``StateStore`` (job views)
metric history                  ``ty:mh:{job}:*`` (:mod:`.metrics_history`)  :class:`MetricHistory` ``query``
goodput (ledgers, history)      ``goodput_final``, ``goodput_history``       :class:`GoodputAccountant`
calibration (samples, fit)      ``calibration_samples``, ``calibration``     :class:`CalibrationStore`
==============================  ==========================================  ================================
"""

from trainyard_telemetry.accounting import GoodputAccountant
from trainyard_telemetry.calibrator import CalibrationStore
from trainyard_telemetry.goodput import Ledger, StepTiming
from trainyard_telemetry.metrics_history import MetricHistory
from trainyard_telemetry.steptiming import StepTimingStore

__all__ = ["CalibrationStore", "GoodputAccountant", "Ledger", "MetricHistory", "StepTiming", "StepTimingStore"]
