"""SIGTERM preemption under pipeline stages, through the CLI (issue 42's check): 2 stages on 2 processes save one
sharded checkpoint at the same step and exit 143, and a relaunch without stages continues it exactly."""

import math
import signal
from pathlib import Path

import pytest
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.checkpoint.safe_load import SafeReader
from tests.training.test_preemption import CONFIGS, PRINT_STEPS, SIGNAL_AT, finish, fit_command, launch, losses, \
    step_of

COMMON = ("--trainer.max_steps=6", PRINT_STEPS, "--trainer.strategy.init_args.expert_parallel_size=1")
TWO_STAGES = ("--trainer.strategy.init_args.pipeline_parallel_size=2",
              "--trainer.strategy.init_args.pipeline_microbatches=2")  # the yaml's 8 sequences a step, 2 x 4
# Without stages the 2 processes are 2 data replicas: half the yaml's batch each keeps the 8 sequences a step.
ONE_STAGE = ("--trainer.strategy.init_args.pipeline_parallel_size=1", "--data.init_args.batch_size=4")


def _check_holds_every_key_once(path) -> None:
    """The checkpoint's DCP metadata: the whole model's state (every key of the model, each tensor's chunks
    covering it exactly once), and every parameter's AdamW state, whichever stage held it."""
    entries = SafeReader(path).read_metadata().state_dict_metadata
    config = yaml.safe_load((CONFIGS / "tiny-fsdp.yaml").read_text())["model"]["init_args"]["config"]
    module = MoELanguageModel(MoEConfig(**config))
    module.configure_model()
    assert {k.removeprefix("state_dict.") for k in entries if k.startswith("state_dict.")} == set(module.state_dict())
    for name, tensor in module.state_dict().items():
        meta = entries[f"state_dict.{name}"]
        assert isinstance(meta, TensorStorageMetadata) and tuple(meta.size) == tuple(tensor.shape)
        assert sum(math.prod(chunk.sizes) for chunk in meta.chunks) == tensor.numel(), name
    for name, _ in module.named_parameters():
        assert {f"optimizer_0.state.{name}.{key}" for key in ("step", "exp_avg", "exp_avg_sq")} <= set(entries)


@pytest.mark.slow
def test_sigterm_at_two_stages_saves_one_checkpoint_and_a_relaunch_without_stages_resumes_exactly(tmp_path):
    """`moe-lightning fit --config configs/tiny-fsdp.yaml` at 2 stages x 2 micro-batches on 2 processes, SIGTERM to
    the main process (the first stage) from inside the run as step 2 starts (``SignalAtStep``: no race with the
    run's pace on a loaded machine): the last stage, which never saw the signal, stops
    at the same step through the agreed flag, and both write their halves of one checkpoint (each key once); exit
    143. The relaunch without stages from that checkpoint (the same 8 sequences a step) gives, with the steps
    before the signal, every per-step loss of an uninterrupted run without stages, to 1e-6 relative (fp32: the
    same terms summed in another order at 2 stages)."""
    reference = launch(fit_command("tiny-fsdp.yaml", tmp_path / "ref", *COMMON, *ONE_STAGE), tmp_path / "ref")
    out = finish(reference)
    assert reference.returncode == 0, out[-3000:]

    staged = launch(fit_command("tiny-fsdp.yaml", tmp_path / "job", *COMMON, *TWO_STAGES, SIGNAL_AT,
                                "--trainer.callbacks.step=2"), tmp_path / "job")  # to rank 0 alone
    out = finish(staged)
    assert staged.returncode == 128 + signal.SIGTERM, out[-3000:]
    final = [line for line in out.splitlines() if line.startswith("preempted at step")]
    assert len(final) == 1 and out.count("SIGTERM received") == 1, out[-3000:]
    step, path = int(final[0].split()[3].rstrip(",")), Path(final[0].split("checkpoint at ")[1])
    assert path.is_dir() and step_of(path) == step and 3 <= step < 6
    _check_holds_every_key_once(path)

    resumed = launch(fit_command("tiny-fsdp.yaml", tmp_path / "job", *COMMON, *ONE_STAGE, f"--ckpt_path={path}"),
                     tmp_path / "job")
    out = finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    got, want = losses(tmp_path / "job"), losses(tmp_path / "ref")
    assert sorted(got) == sorted(want) == list(range(6))
    assert got == pytest.approx(want, rel=1e-6)
