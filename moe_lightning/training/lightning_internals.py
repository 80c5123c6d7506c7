"""Every private Lightning name the package relies on, in one place, with why no public hook serves.

A Lightning upgrade that renames one of these breaks here or in the line the table names, nowhere else.
The first group is reached only through the functions below; the second group overrides or calls private
methods of classes the package subclasses or drives, in the module named.

Reached through this module:

- ``_TrainingEpochLoop._should_accumulate()`` (``optimizer_step_ends``): whether this micro-batch ends an
  optimizer step. Lightning exposes no flag for it; ``global_step`` alone cannot say (it changes only after the
  step), and the loop's own test is the one that decides whether it steps.
- ``Trainer._logger_connector.should_update_logs`` (``logs_written``): whether ``self.log`` values of this batch
  are written; no public property.
- ``Trainer._logger_connector.on_batch_end()`` / ``update_train_step_metrics()`` (``write_step_metrics``): a
  preempted step's metrics are written by Lightning only after the hook that stops the run.
- ``Trainer._accelerator_connector.cluster_environment`` (``cluster_environment``): strategies that are not
  ``ParallelStrategy`` have no ``cluster_environment``; SLURM's requeue signal and spawned children are read there.
- ``Trainer._signal_connector`` (replaced) and ``_SignalConnector`` (subclassed) (``install_signal_handlers``):
  Lightning installs its own SIGTERM handler after the checkpoint is restored; it exits 0 and broadcasts from
  inside the handler (a hang with several processes). No hook replaces it.
- ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (replaced by a no-op, same function): Lightning broadcasts its
  SIGTERM flag from rank 0 before every batch, a collective and a device read per step for a flag that is
  always 0 once its handler is replaced.

Private names of classes the package subclasses or drives, used where named:

- ``callbacks/run_folders.py`` (``allocate_run_folder``): ``CSVLogger/TensorBoardLogger._version`` and
  ``_get_next_version()``: the loggers choose ``max(existing) + 1`` without creating it; the version an exclusive
  ``mkdir`` won is pinned.

- ``callbacks/final_checkpoint.py``: ``ModelCheckpoint._monitor_candidates``, ``_save_topk_checkpoint``,
  ``_save_checkpoint``, ``_save_last_checkpoint``, ``_last_global_step_saved``, ``_last_checkpoint_saved``: the
  final save is named, ranked and rotated as the trainer's own ``ModelCheckpoint`` would; it has no public
  "save now" method.
- ``cli.py``: ``LightningCLI._parse_ckpt_path`` (overridden: the checkpoint's hyperparameters silently beat the
  command line), ``_prepare_subcommand_parser`` and ``_subcommand_method_arguments`` (``predict``'s own
  arguments: no public per-subcommand hook), ``_run_subcommand`` (wrapped: the run folder is removed when the
  run fails before writing anything), ``_get`` and ``_parser`` (the trainer's config and ``fit``'s parser, which
  ``plan`` composes configs with exactly as ``fit`` does).
- ``callbacks/console.py``: ``tqdm_progress._update_n`` (how Lightning's own bar sets its count and refreshes;
  the step bar counts ``global_step`` with it) and ``model_summary._format_summary_table`` (Lightning's table, so
  the summary without FLOPs looks like Lightning's; no public formatter).
- ``strategy.py`` and its checkpoint hooks (``checkpoint_io.py``): ``ModelParallelStrategy._setup_distributed``,
  ``_device_mesh`` and ``_save_distributed_checkpoint`` (the strategy builds its own mesh and checkpoint layout on
  Lightning's); ``_PATH`` (Lightning's path type, in the signatures it overrides); the evaluation loops' ``inference_mode``,
  set through ``evaluate_under_no_grad`` here (a public attribute of private loop classes: Lightning decides
  no_grad vs inference_mode from the strategy's class, and FSDP2's all-gather buffers made under inference_mode
  break the next training step; no setting chooses it).
"""

import signal
from collections.abc import Callable

from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn


def optimizer_step_ends(trainer) -> bool:
    """True in a training batch whose optimizer step runs (the last micro-batch of an accumulation); in
    ``on_train_batch_end`` the step has just been taken. The package's one step-boundary test."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def logs_written(trainer) -> bool:
    """Whether Lightning writes what ``self.log`` receives in this training batch: the optimizer step's last
    micro-batch on the ``log_every_n_steps`` grid (its ``update_train_step_metrics``). Log per-step numbers only
    then: each Python number logged becomes a device tensor through a blocking host-to-device copy."""
    return optimizer_step_ends(trainer) and bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def evaluate_under_no_grad(trainer) -> None:
    """Run a standalone validate/test/predict under ``torch.no_grad``, as inside fit. Lightning would choose
    ``torch.inference_mode`` unless the backend is gloo or the strategy is its own ``FSDPStrategy``
    (``loops/utilities.py``, ``_no_grad_context``); FSDP2's all-gather buffers made there are inference tensors, and
    the next training all-gather writes into them and fails ("Inplace update to inference tensor outside
    InferenceMode")."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


def write_step_metrics(trainer) -> None:
    """Write the current step's logged metrics now (Lightning would after ``on_train_batch_end``)."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


def cluster_environment(trainer):
    return getattr(trainer.strategy, "cluster_environment", None) or trainer._accelerator_connector.cluster_environment


class _Handlers(_SignalConnector):
    """The trainer's signal connector, reduced to: install ``handler`` for ``signals`` once, restore the previous
    handlers at teardown. ``received_sigterm`` stays False, so Lightning's loops never raise their exit-0
    ``SIGTERMException``."""

    def __init__(self, trainer, signals: list[int], handler: Callable):
        super().__init__(trainer)
        self.signals, self.handler = signals, handler

    def register_signal_handlers(self) -> None:  # Lightning calls it again after the restore: keep the first
        if self.trainer.state.fn != TrainerFn.FITTING:  # a later validate/test/predict: Lightning's own
            return super().register_signal_handlers()
        self.received_sigterm = False
        if not self._original_handlers:
            self._original_handlers = {s: signal.getsignal(s) for s in self.signals}
            for signum in self.signals:
                self._register_signal(signum, self.handler)


def install_signal_handlers(trainer, signals: list[int], handler: Callable) -> None:
    """Install ``handler`` now (Lightning's own would come only after the checkpoint is restored) in place of
    Lightning's signal handling; the trainer's teardown restores the previous handlers."""
    connector = _Handlers(trainer, signals, handler)
    trainer._signal_connector = connector
    connector.register_signal_handlers()
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        epoch_loop._broadcast_sigterm_tensor = lambda: None
