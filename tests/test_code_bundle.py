"""What a run ships of the folder it is launched from: the user's code, not their weights, data, run
outputs or virtualenv; the same files give the same digest, an edited file another one."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from trellis.engine.config.loading import load_config
from trellis.engine.run import code_bundle
from trellis.engine.run.code_bundle import CodeBundleError, shipped_code
from trellis.engine.run.identity import WorkerFingerprint


def make_project(root: Path) -> None:
    (root / "helpers").mkdir(parents=True)
    (root / "myreward.py").write_text("from helpers.parse import answer\n\ndef score(sample):\n    return 1.0\n")
    (root / "helpers" / "parse.py").write_text("def answer(text):\n    return text.strip()\n")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    (root / "model" / "model.safetensors").write_bytes(b"\0" * 1024)
    (root / "data").mkdir()
    (root / "data" / "train.parquet").write_bytes(b"PAR1")
    (root / "runs" / "old").mkdir(parents=True)
    (root / "runs" / "old" / "metrics.jsonl").write_text("{}\n")
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "big.py").write_text("x = 1\n")
    (root / "notes.tmp").write_text("scratch")
    (root / ".gitignore").write_text("*.tmp\n")
    (root / "stray.pt").write_bytes(b"\0" * 16)


def config_for(root: Path, **changes):
    fields = dict(load_from=str(root / "model"), train_dataset={"path": str(root / "data" / "train.parquet")},
                  work_dir=str(root / "runs"), total_train_steps=1, reward={"function": "myreward:score"},
                  cluster={"code_dir": str(root)})
    return load_config(None, **{**fields, **changes})


def test_the_bundle_holds_the_code_and_nothing_the_workers_read_elsewhere(tmp_path, monkeypatch):
    make_project(tmp_path / "project")
    monkeypatch.setattr(code_bundle.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    bundle = shipped_code(config_for(tmp_path / "project"))
    with zipfile.ZipFile(bundle.zip_path) as archive:
        names = sorted(archive.namelist())
    assert names == [".gitignore", "helpers/parse.py", "myreward.py"]
    assert bundle.files == 3 and bundle.root == str((tmp_path / "project").resolve())


def test_the_digest_follows_the_content(tmp_path, monkeypatch):
    root = tmp_path / "project"
    make_project(root)
    monkeypatch.setattr(code_bundle.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    config = config_for(root)
    first, again = shipped_code(config), shipped_code(config)
    assert first == again  # the same files: the same digest and the same zip, not rewritten
    (root / "runs" / "old" / "metrics.jsonl").write_text("{}\n{}\n")  # outputs are not code
    assert shipped_code(config).digest == first.digest
    (root / "helpers" / "parse.py").write_text("def answer(text):\n    return text\n")
    edited = shipped_code(config)
    assert edited.digest != first.digest
    assert WorkerFingerprint.of(config, edited).differences(WorkerFingerprint.of(config, first))[0].startswith("the user code")


def test_functions_of_installed_packages_ship_nothing(tmp_path):
    make_project(tmp_path / "project")
    assert shipped_code(config_for(tmp_path / "project", reward={"function": "trellis.engine.rollout.rewards:exact_match"})) is None


def test_a_launch_folder_too_big_to_ship_says_what_to_leave_out(tmp_path, monkeypatch):
    root = tmp_path / "project"
    make_project(root)
    (root / "corpus.jsonl").write_bytes(b"x" * 2048)
    monkeypatch.setattr(code_bundle, "MAX_BUNDLE_BYTES", 1024)
    with pytest.raises(CodeBundleError, match=r"Largest: corpus.jsonl .*cluster.code_excludes"):
        shipped_code(config_for(root))
    monkeypatch.setattr(code_bundle.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert shipped_code(config_for(root, cluster={"code_dir": str(root), "code_excludes": ["*.jsonl"]})).files == 3


def test_a_package_imported_from_outside_the_launch_folder_ships_as_a_py_module(tmp_path, monkeypatch):
    """A reward package on PYTHONPATH (here: sys.path) and a lone module beside it: each ships as a zip
    of its own for Ray's py_modules (the package under its name), the launch folder not at all when no
    function lives there; the digest follows the outside code too."""
    make_project(tmp_path / "project")
    outside = tmp_path / "shared-code"
    (outside / "team_rewards" / "__pycache__").mkdir(parents=True)
    (outside / "team_rewards" / "__init__.py").write_text("")
    (outside / "team_rewards" / "math.py").write_text("def score(sample):\n    return 1.0\n")
    (outside / "team_rewards" / "__pycache__" / "math.cpython-311.pyc").write_bytes(b"\0")
    (outside / "lone_reward.py").write_text("def score(sample):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(outside))
    monkeypatch.setattr(code_bundle.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    config = config_for(tmp_path / "project", reward={"function": "team_rewards.math:score",
                                                      "by_data_source": {"lone": "lone_reward:score"}})
    bundle = shipped_code(config)
    assert bundle.zip_path is None  # no function in the launch folder
    assert bundle.module_sources == (str(outside / "team_rewards"), str(outside / "lone_reward.py"))
    contents = [sorted(zipfile.ZipFile(module).namelist()) for module in bundle.modules]
    assert contents == [["team_rewards/__init__.py", "team_rewards/math.py"], ["lone_reward.py"]]
    (outside / "team_rewards" / "math.py").write_text("def score(sample):\n    return 2.0\n")
    assert shipped_code(config).digest != bundle.digest
