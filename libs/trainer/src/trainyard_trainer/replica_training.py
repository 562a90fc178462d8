"""The built-in trainer for a job with ``faultTolerance``: this rank is one replica of the spec's GPT, joined to the
others per step by torchft (``run.replicas``, :mod:`trainyard.replicas`); a replica that fails is replaced while
the others train on (docs/failures.md, "A replica fails, training goes on").

Each replica is a world of one: the whole model, no tensor or pipeline split (the spec refuses them with
``faultTolerance``). Per step: the quorum (``optimizer.zero_grad``), this replica's micro-batches of the step
(``faultTolerance.batch``), forward and backward through torchft's DDP (gradients averaged over the quorum), the
gradient clipped, the update applied only if the quorum committed, then the LR schedule, the boundary (replica 0
saves) and StepMetrics with the replicas that stepped. Replica 0's run record has a ``replicas`` section: the
steps it committed, those with fewer replicas, the abandoned ones and, for a newcomer, the step it healed at.
"""

from __future__ import annotations

import logging
import math

import torch
from trainyard import Run
from trainyard.metrics import flops_per_token
from trainyard.runrecord import RUN_RECORD_FILE, ReplicasRecord, local_environment
from trainyard.state import Progress, checkpoint_state
from trainyard_contract.errors import DataError, NonFiniteError

from trainyard_trainer.model import build_model
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard_trainer.training import Job, RecordKeeper, build_optimizer, initial_record

log = logging.getLogger("trainyard_trainer")


def train_replica(job: Job, run: Run) -> Progress:
    """Train this replica until the job's step counter reaches ``maxSteps``; returns the final counters."""
    settings, spec, runtime = job.settings, job.spec, job.runtime
    training, progress = spec.training, run.progress
    ft = spec.fault_tolerance
    assert ft is not None
    loader = run.data_loader(dp=ft.replicas, dp_rank=settings.rank)  # its state is the step's global position
    if loader.dataset.manifest.tokenizer.vocab_size > job.model_config.vocab_size:
        raise DataError(f"dataset {spec.dataset} has a vocabulary of {loader.dataset.manifest.tokenizer.vocab_size},"
                        f" the model only {job.model_config.vocab_size}")
    model = build_model(job.model_config, seed=training.seed, device=runtime.device)
    optimizer = build_optimizer(model, spec)
    lr_scheduler = build_lr_scheduler(optimizer, schedule=training.lr_schedule, max_steps=training.max_steps)
    state = checkpoint_state(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=loader.sampler,
                             progress=progress, rng=run.rng)
    run.parallelism = {"dp": 1, "tp": 1, "pp": 1}  # replica 0's checkpoints: the whole model, a world of one
    run.restore(state)
    assert run.restored is not None and job.batch is not None
    fpt = flops_per_token(job.model_config, training.sequence_length)
    record = None if settings.rank != 0 else initial_record(
        job, job.batch, run.ctx.gather(local_environment()), run.restored, fpt, None, model.num_parameters(),
        start_step=progress.global_step, start_position=loader.sampler.position, progress=progress)
    keeper = RecordKeeper(job, record, run.attempt_dir / RUN_RECORD_FILE, None, fpt, progress, loader.sampler)
    replicas = run.replicas(model, optimizer, extra={"lr_scheduler": lr_scheduler})
    if record is not None:
        record.replicas = ReplicasRecord(replicas=ft.replicas, min_replicas=ft.min_replicas, batch=ft.batch)
    keeper.flush()
    log.info("replica %d of %d: model %s, %d parameters; batch %s", settings.rank, ft.replicas,
             spec.model_config_ref if isinstance(spec.model_config_ref, str) else "inline",
             model.num_parameters(), ft.batch)
    model.train()
    try:
        while replicas.step < training.max_steps:
            replicas.optimizer.zero_grad(set_to_none=True)  # the step's quorum
            batches = replicas.batch(lambda dp, rank: loader if (dp, rank) == (ft.replicas, settings.rank)
                                     else run.data_loader(dp=dp, dp_rank=rank))
            loss_sum = torch.zeros((), device=runtime.device)
            for inputs, targets in batches:
                with runtime.autocast():
                    _, loss = replicas.model(inputs, targets)
                (loss * replicas.scale).backward()
                loss_sum += loss.detach()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip or math.inf))
            loss_value = float(loss_sum.item()) / max(1, len(batches))
            lr = optimizer.param_groups[0]["lr"]
            if not replicas.commit():  # a replica failed during the step: the next quorum runs it again
                continue
            if not math.isfinite(loss_value) or not math.isfinite(grad_norm):
                raise NonFiniteError(f"loss {loss_value} / grad norm {grad_norm} is not finite")
            lr_scheduler.step()
            step = replicas.step
            run.checkpoint(step, state, on_durable=keeper.shard)
            m = replicas.metrics()
            keeper.step(run.report(step, loss=loss_value, lr=float(lr), grad_norm=grad_norm, replicas=m["replicas"],
                                   replicas_missing=m["replicas_missing"], degraded_steps=m["degraded_steps"]))
            if record is not None and record.replicas is not None:
                c = replicas.counts
                record.replicas = record.replicas.model_copy(update={
                    "committed": c.committed, "degraded_total": c.degraded_total, "degraded_steps": list(c.degraded),
                    "not_committed": c.not_committed, "healed_at": c.healed_at})
            if run.stopped is not None:
                raise run.stopped
        run.wait()
    except BaseException as exc:
        run.checkpointer.close()
        keeper.failed(exc, failed_step=run.end.global_step, signalled=run.request.signalled)
        raise
    keeper.flush(status="succeeded", exit_code=0)
    return progress
