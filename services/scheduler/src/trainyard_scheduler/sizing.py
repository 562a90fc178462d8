"""Device memory a spec needs at the very least (pure; trainyard_planner's memory model).

The scheduler refuses a device type only when the gang cannot fit it however it is run: the
estimate assumes the most memory-frugal layout the trainer could use for the spec's dp × tp × pp
(``LayoutAssumption.MOST_FRUGAL``: ZeRO-3 / FSDP across the data-parallel ranks, full activation
recomputation), no headroom, and the planner's default (mixed-precision Adam) bytes per parameter.
The API's submission check maps the same spec with ``LayoutAssumption.TRAINER_DEFAULTS`` instead.
Choosing a good layout is the planning endpoint's job, not the scheduler's.
"""

from __future__ import annotations

import logging

from trainyard_contract.catalog import ModelConfig, resolve_model
from trainyard_contract.errors import TrainyardError
from trainyard_contract.spec import TrainingSpec

log = logging.getLogger(__name__)


def min_device_memory(spec: TrainingSpec) -> int:
    """Bytes per device below which the gang can never run; 0 when it cannot be estimated."""
    try:
        from trainyard_planner import LayoutAssumption, Transformer, estimate_memory, spec_layout

        ref = spec.model_config_ref
        config = ref if isinstance(ref, ModelConfig) else resolve_model(ref)
        # the shape's own count (positions up to sequenceLength), not transformer_for's declared one
        model = Transformer.from_model_config(config, seq_len=spec.training.sequence_length)
        layout = spec_layout(spec, assume=LayoutAssumption.MOST_FRUGAL)
        return int(estimate_memory(model, layout, headroom=0.0).required_bytes_per_device)
    except (TrainyardError, KeyError, ValueError, ArithmeticError) as exc:  # an estimate we cannot make never
        # blocks a job (KeyError: a model the catalog lacks; the API refuses those at submission)
        log.warning("no device-memory floor for a job of model %s (the memory check is off for it): %s",
                    spec.model_config_ref if isinstance(spec.model_config_ref, str) else "<inline>", exc)
        return 0
