"""``trellis replay RUN@STEP``: a stored step applied again from the policy before it, with the run's
settings (the run's own update, bit for bit) and with changed ones (what the change does to the loss,
the advantages and the updated policy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trellis.deployments.cli import app
from trellis.engine.run.local import LocalRun
from trellis.engine.run.replay import ReplayError, replay_step
from trellis.engine.storage.store import Store
from helpers import logged_metrics, tiny_config


@pytest.fixture(scope="module")
def stored_run(tiny_model, reverse_data, tmp_path_factory):
    """Three in-process steps, a checkpoint and an HF export at step 2 (the update a replay must match)."""
    config = tiny_config(tiny_model, reverse_data, tmp_path_factory.mktemp("replayed"), total_train_steps=3,
                         checkpoint_interval=2, hf_interval=2, enable_evaluate=False)
    with LocalRun(config) as run:
        run.run()
    return config


def test_a_step_replayed_unchanged_is_the_runs_own_update_bit_for_bit(stored_run):
    """Step 2 has no checkpoint before it: the replay starts where the run did and replays step 1 first."""
    same = replay_step(Store(stored_run.run_uri), 2, [])
    assert same.bridged_steps == [1] and same.identical_updates and "where the run started" in same.start
    assert same.policy_kl == 0.0 and same.tokens_with_other_advantage == 0 and same.trained_tokens > 0
    logged = logged_metrics(stored_run)[2]
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
        assert same.figures[key]["as_run"] == logged[key], key  # equal, not approximately
    # The updated policy is the one the run exported after step 2, every tensor bit for bit.
    assert same.matches_run_export is True
    assert json.loads(Path(same.folder, "comparison.json").read_text())["matches_run_export"] is True


def test_a_changed_setting_shows_in_the_loss_the_advantages_and_the_updated_policy(stored_run):
    changed = replay_step(Store(stored_run.run_uri), 3, ["advantage.estimator=drgrpo", "optim.lr=1e-3"])
    assert changed.bridged_steps == [] and changed.start.endswith("checkpoints/step-000002")
    assert not changed.identical_updates and changed.policy_kl > 0 and changed.policy_logprob_diff_max > 0
    assert 0 < changed.tokens_with_other_advantage <= changed.trained_tokens  # drgrpo leaves out the std
    assert changed.figures["train/lr"]["changed"] == pytest.approx(1e-3)  # the checkpoint's optimizer does not bring 3e-4 back
    pg = changed.figures["train/pg_loss"]
    assert pg["as_run"] == logged_metrics(stored_run)[3]["train/pg_loss"] and pg["changed"] != pg["as_run"]
    page = Path(changed.folder, "comparison.md").read_text()
    assert "`advantage.estimator=drgrpo`" in page and "| train/pg_loss |" in page


def test_the_command_line_replays_a_run_by_name_and_refuses_what_it_cannot(stored_run):
    work_dir, name = str(Path(stored_run.run_uri).parent), stored_run.experiment_name
    for _ in range(2):  # the same replay again starts over in its folder
        result = CliRunner().invoke(app, ["replay", f"{name}@3", "--work-dir", work_dir, "--set", "loss.kl_coef=0.1", "--name", "kl"])
        assert result.exit_code == 0, result.output
    assert "Replay of step 3" in result.output and Path(stored_run.run_uri, "replays", "step-000003-kl", "comparison.md").exists()
    missing = CliRunner().invoke(app, ["replay", f"{name}@9", "--work-dir", work_dir])
    assert missing.exit_code == 2 and "no stored train batch for step 9" in missing.output
    no_step = CliRunner().invoke(app, ["replay", name, "--work-dir", work_dir])
    assert no_step.exit_code == 2 and "name the step" in no_step.output
    with pytest.raises(ReplayError, match="no logs/config.json"):
        replay_step(Store(str(Path(work_dir) / "nowhere")), 1, [])
