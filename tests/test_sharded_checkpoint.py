"""Sharded checkpoints reshard: what two fully_shard ranks save after an AdamW step loads, weights and
AdamW moments bit for bit, at world size 1 (a plain model without a process group, and fully_shard),
at world size 4, and through ``s3://``; a checkpoint that does not fit the model is refused by name.

Ranks are real processes joined by a gloo group on loopback. They start from a preloaded forkserver,
so torch and transformers are imported once for all seven ranks instead of once per rank.
"""

from __future__ import annotations

import multiprocessing.forkserver
import re
import socket
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from trellis.engine.storage.checkpoints import CheckpointError
from trellis.engine.storage.store import Store
from trellis.engine.tiny.model import build_tiny_checkpoint
from trellis.engine.train import fsdp
from trellis.engine.train.sharded_checkpoint import is_sharded, load_sharded, save_sharded
from helpers import moto_s3_server

BUCKET = "sharded"
# What the ranks import, imported once by the forkserver (it cannot import this module itself: the
# forkserver of Python 3.11 ignores the sys.path that puts tests/ on it).
PRELOAD = ["pytest", "s3fs", "transformers.models.auto.modeling_auto", "trellis.engine.tiny.model", "trellis.engine.train.sharded_checkpoint"]


# -- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forkserver() -> None:
    """Start the forkserver now, so that it imports while the model and the S3 server are built."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model's architecture, tied embeddings included; its weights need no warm-up here."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", warmup=False)


@pytest.fixture(scope="module")
def s3_options():
    """moto's S3 server on loopback, with its bucket, as the storage options s3fs takes."""
    with moto_s3_server() as endpoint:
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}}
        fsspec.filesystem("s3", **options).mkdir(BUCKET)
        yield options


@pytest.fixture(scope="module")
def saved(forkserver, model_dir, s3_options, tmp_path_factory) -> dict[str, Any]:
    """Two fully_shard ranks take one AdamW step, then save to a local folder and to S3; rank 0 keeps
    the full weights and moments they saved as the reference."""
    root = tmp_path_factory.mktemp("sharded")
    out = {"local": str(root / "step-000001"), "s3": f"s3://{BUCKET}/run/step-000001", "reference": str(root / "reference.pt")}
    _run(2, _save_after_one_step, str(model_dir), [(out["local"], {}), (out["s3"], s3_options)], out["reference"])
    return out


# -- tests --------------------------------------------------------------------------------------------


def test_two_ranks_write_only_their_own_shards(saved):
    for part in ("model", "optim"):
        files = sorted(p.name for p in Path(saved["local"], part).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert is_sharded(Store(saved["local"])) and is_sharded(Store(f"file://{saved['local']}"))


def test_loads_at_world_size_one_without_a_process_group_and_with_fsdp(model_dir, saved):
    _run(1, _load_at_one, str(model_dir), saved["local"], saved["reference"])


def test_loads_at_world_size_four(model_dir, saved):
    _run(4, _load_sharded, str(model_dir), saved["local"], saved["reference"])


def test_loads_from_s3_at_world_size_one(model_dir, saved, s3_options):
    assert is_sharded(Store(saved["s3"], s3_options))
    assert fsspec.filesystem("s3", **s3_options).exists(f"{BUCKET}/run/step-000001/optim/__1_0.distcp")
    policy, optimizer = _build(model_dir, sharded=False)
    model = policy.model
    load_sharded(Store(saved["s3"], s3_options), model, optimizer)
    _assert_restored(model, optimizer, saved["reference"])


def test_a_missing_or_incomplete_folder_is_refused_by_name(model_dir, tmp_path):
    policy, optimizer = _build(model_dir, sharded=False)
    model = policy.model
    missing = tmp_path / "step-000009"
    assert not is_sharded(Store(str(missing)))
    with pytest.raises(CheckpointError, match=f"{re.escape(str(missing))} does not exist"):
        load_sharded(Store(str(missing)), model, optimizer)
    missing.mkdir()
    with pytest.raises(CheckpointError, match=r"holds no sharded checkpoint \(no model/.metadata\)"):
        load_sharded(Store(str(missing)), model, optimizer)


def test_a_checkpoint_without_optimizer_state_loads_only_without_an_optimizer(model_dir, tmp_path):
    policy, optimizer = _build(model_dir, sharded=False)
    model = policy.model
    save_sharded(Store(str(tmp_path)), model, None)
    assert is_sharded(Store(str(tmp_path))) and not (tmp_path / "optim").exists()
    with pytest.raises(CheckpointError, match="saved without optimizer state"):
        load_sharded(Store(str(tmp_path)), model, optimizer)
    load_sharded(Store(str(tmp_path)), model, None)


def test_skip_checkpoint_validation_skips_dcps_plan_check_only_while_saving(model_dir, tmp_path, monkeypatch):
    """Tried: a plan check that always fails. It fails a save; skipped, the save goes through and loads
    back, and the check is DCP's own again afterwards."""
    from torch.distributed.checkpoint import default_planner

    def refuse(global_plan, metadata):
        return ["injected plan problem"]

    monkeypatch.setattr(default_planner, "_validate_global_plan", refuse)
    model = _build(model_dir, sharded=False)[0].model
    with pytest.raises(CheckpointError, match="(?s)checked/model could not be saved: .*injected plan problem"):
        save_sharded(Store(str(tmp_path / "checked")), model, None)
    save_sharded(Store(str(tmp_path / "unchecked")), model, None, validate=False)
    assert default_planner._validate_global_plan is refuse
    load_sharded(Store(str(tmp_path / "unchecked")), _build(model_dir, sharded=False)[0].model, None)


def test_a_damaged_shard_is_refused_as_a_checkpoint_error(model_dir, tmp_path):
    """Tried: a shard file cut to half its length. DCP raises a BaseException; the run gets a CheckpointError."""
    model = _build(model_dir, sharded=False)[0].model
    save_sharded(Store(str(tmp_path)), model, None)
    shard = tmp_path / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{re.escape(str(tmp_path))}/model could not be loaded"):
        load_sharded(Store(str(tmp_path)), _build(model_dir, sharded=False)[0].model, None)


def _extra(model):
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    return r"missing from the checkpoint \['extra'\], not in the model \[\]"


def _renamed(model):
    mlp = model.model.layers[1].mlp
    mlp.gate = mlp.gate_proj
    del mlp.gate_proj
    return (r"missing from the checkpoint \['model.layers.1.mlp.gate.weight'\], "
            r"not in the model \['model.layers.1.mlp.gate_proj.weight'\]")


def _reshaped(model):
    model.model.norm.weight = torch.nn.Parameter(torch.ones(5))
    return r"model.norm.weight is \[128\] there, \[5\] in the model"


@pytest.mark.parametrize("change", [_extra, _renamed, _reshaped], ids=["extra", "renamed", "reshaped"])
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_by_name(model_dir, saved, change):
    model = _build(model_dir, sharded=False)[0].model
    expected = change(model)
    with pytest.raises(CheckpointError, match=f"{re.escape(saved['local'])}/model does not match the model.*{expected}"):
        load_sharded(Store(saved["local"]), model, None)


def test_an_optimizer_over_other_parameters_is_refused_by_name(model_dir, saved):
    policy, _ = _build(model_dir, sharded=False)
    model = policy.model
    frozen = "model.layers.3.mlp.down_proj.weight"
    optimizer = torch.optim.AdamW([p for name, p in model.named_parameters() if name != frozen])
    with pytest.raises(CheckpointError, match=rf"/optim does not match the model's optimizer state: .*not in the model \['{frozen}'\]"):
        load_sharded(Store(saved["local"]), model, optimizer)


# -- ranks ----------------------------------------------------------------------------------------------


def _run(world: int, rank_main: Callable, *args: Any) -> None:
    """``rank_main(rank, world, port, *args)`` in ``world`` new processes; a rank's failure fails the test."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(rank_main, args=(world, port, *args), nprocs=world, start_method="forkserver")


def _join(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _save_after_one_step(rank, world, port, model_dir, folders, reference):
    _join(rank, world, port)
    policy, optimizer = _build(model_dir, sharded=True)
    model = policy.model
    ids = torch.arange(48).reshape(4, 12) % model.config.vocab_size
    policy(ids).backward()
    optimizer.step()
    for folder, options in folders:
        save_sharded(Store(folder, options), model, optimizer)
    snapshot = _snapshot(model, optimizer)
    if rank == 0:
        torch.save(snapshot, reference)
    dist.destroy_process_group()


def _load_at_one(rank, world, port, model_dir, folder, reference):
    assert not dist.is_initialized()
    policy, optimizer = _build(model_dir, sharded=False)
    model = policy.model
    load_sharded(Store(folder), model, optimizer)
    _assert_restored(model, optimizer, reference)

    _join(rank, world, port)
    policy, optimizer = _build(model_dir, sharded=True)
    model = policy.model
    load_sharded(Store(folder), model, optimizer)
    _assert_restored(model, optimizer, reference)
    dist.destroy_process_group()


def _load_sharded(rank, world, port, model_dir, folder, reference):
    _join(rank, world, port)
    policy, optimizer = _build(model_dir, sharded=True)
    model = policy.model
    load_sharded(Store(folder), model, optimizer)
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, DTensor) and embedding.to_local().shape[0] < embedding.shape[0]
    _assert_restored(model, optimizer, reference)
    dist.destroy_process_group()


# -- model, snapshot -------------------------------------------------------------------------------------


class _Root(torch.nn.Module):
    """Stands for the trainer's ``Policy``: the FSDP root holds the model, and the model is saved."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def _build(model_dir, *, sharded: bool) -> tuple[_Root, torch.optim.Optimizer]:
    """The policy as the trainer builds it: fully_shard per decoder layer, then the root."""
    policy = _Root(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    if sharded:
        fsdp.shard(policy, policy.model.get_decoder().layers, torch.device("cpu"), None)
        for module in policy.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has neither AVG nor PREMUL_SUM
    return policy, torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Full weights and AdamW state by name, the same whatever the world size."""
    def full(tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()

    out = {f"weight/{name}": full(t) for name, t in model.state_dict().items()}
    for name, state in get_optimizer_state_dict(model, optimizer)["state"].items():
        out.update({f"adamw/{name}/{key}": full(value) for key, value in state.items()})
    return out


def _assert_restored(model, optimizer, reference) -> None:
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    expected, actual = torch.load(reference, weights_only=True), _snapshot(model, optimizer)
    assert sorted(actual) == sorted(expected)
    assert any(name.endswith("/exp_avg_sq") for name in actual)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
