"""torchtitan 0.2.2's checkpoints in and out, checked against torchtitan itself: its model gives the logits of
this recipe's after the RoPE permutation, its dataset stands where the written loader state says, and its own
Trainer continues a run of this recipe (and this recipe one of its) with the losses of the run it left."""

from __future__ import annotations

import json
import math
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint.torchtitan import interleaved_weights, to_interleaved, to_rotate_half, torchtitan_loader_state
from models import family
from tests.launch import REPO, python, torchrun, two_at_a_time
from tests.torchtitan_trainer import user_folder

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+)")


def test_torchtitans_llama_gives_this_recipes_logits_once_wq_and_wk_rows_are_permuted() -> None:
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    fam = family("llama3")
    args = fam.flavors["debugmodel"]
    theirs, ours = Transformer(llama3_args["debugmodel"]), fam.model_cls(args)
    with torch.no_grad():
        theirs.init_weights()
        ours.init_weights()
    state = theirs.state_dict()
    rope = interleaved_weights(fam, args, state)
    assert sorted(rope) == sorted(
        f"layers.{i}.attention.{w}.weight" for i in range(args.n_layers) for w in ("wq", "wk")
    )
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    with torch.no_grad():
        ours.load_state_dict(state, strict=False)  # as they are: another function
        assert (ours(tokens) - theirs(tokens)).abs().max() > 1e-3
        ours.load_state_dict(
            {k: to_rotate_half(v, rope[k]) if k in rope else v for k, v in state.items()}, strict=False
        )
        assert torch.allclose(ours(tokens), theirs(tokens), atol=1e-5)
    # The way out undoes the way in, and torchtitan's own Hugging Face adapter permutes its rows as the way in does.
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    adapter = Llama3StateDictAdapter(llama3_args["debugmodel"], None)
    w = state["layers.0.attention.wk.weight"]
    assert torch.equal(to_interleaved(to_rotate_half(w, 16), 16), w)
    assert torch.equal(adapter._permute(w, 16), to_rotate_half(w, 16))


@pytest.mark.parametrize("dp", [1, 2])
def test_the_loader_state_written_is_where_torchtitans_dataset_stands(tmp_path: Path, dp: int) -> None:
    """After a step count that wraps around each rank's documents, torchtitan's dataset holds the state written,
    and a fresh one given that state reads on as the one that read there."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    lines = (REPO / "assets" / "corpus" / "stories_validation.jsonl").read_text().splitlines()[:12]
    (tmp_path / "data.json").write_text("\n".join(lines) + "\n")
    tokenizer = HuggingFaceTokenizer(str(REPO / "assets" / "tokenizer"))
    docs = [tokenizer.encode(json.loads(line)["text"], add_bos=True, add_eos=True) for line in lines]
    stream = np.array([t for doc in docs for t in doc])
    window, batch = 33, 3
    steps = int(1.5 * len(stream) / dp / (batch * window))  # half again what a rank's documents hold
    written = torchtitan_loader_state(
        np.cumsum([len(doc) for doc in docs]), lambda start, length: stream[start : start + length],
        samples=steps * batch * dp, window=window, dp=dp, batch_size=batch,
    )  # fmt: skip
    assert written["world_size"] == dp
    for rank in range(dp):

        def dataset(rank: int = rank) -> HuggingFaceTextDataset:
            return HuggingFaceTextDataset("c4_test", str(tmp_path), tokenizer, seq_len=window - 1, dp_rank=rank,
                                          dp_world_size=dp, infinite=True)  # fmt: skip

        theirs = dataset()
        reading = iter(theirs)
        for _ in range(steps * batch):
            next(reading)
        state = pickle.loads(written[f"dp_rank_{rank}"])
        assert state["dataset_state"] == theirs.state_dict()
        assert state["_num_yielded"] == steps and state["_sampler_iter_state"] == {"samples_yielded": steps * batch}
        resumed = dataset()
        resumed.load_state_dict(state["dataset_state"])
        for a, b in zip(
            iter(resumed), [next(reading) for _ in range(7)], strict=False
        ):  # across the end of the documents
            assert torch.equal(a[0]["input"], b[0]["input"]) and torch.equal(a[1], b[1])


def _torchtitan(folder: Path, *args: str) -> dict[int, float]:
    """torchtitan 0.2.2's own Trainer on one CPU rank in `folder`: its losses by step."""
    proc = torchrun(REPO / "tests" / "torchtitan_trainer.py", *args, nproc=1, cwd=folder)
    return {int(m[1]): float(m[2]) for m in _STEP.finditer(_ANSI.sub("", proc.stdout + proc.stderr))}


def _close(a: dict[int, float], b: dict[int, float], steps: range) -> bool:
    return all(math.isclose(a[s], b[s], rel_tol=1e-5) for s in steps)


def test_a_torchtitan_run_continues_here_and_a_run_here_continues_in_torchtitan(tmp_path: Path) -> None:
    """torchtitan trains 2 steps and saves; its own resume and this recipe's (2 ranks, FSDP) from that checkpoint
    give the same losses at steps 3-5. This recipe's step 3, written by scripts/convert_torchtitan.py, resumes in
    torchtitan with the losses this recipe had at steps 4-5. One rank for torchtitan: its loader then reads this
    recipe's token stream, batch for batch (with more, each rank reads its own slice of the documents). The run here
    is also torchtitan's debug_model.toml under torchrun from a torchtitan user's folder."""
    folder = user_folder(tmp_path)
    shape = ["--training.seq_len=256", "--training.mixed_precision_param=float32", "--activation_checkpoint.mode=none",
             "--checkpoint.enable"]  # fmt: skip
    toml = ["--job.config_file", "debug_model.toml"]
    theirs = folder / "theirs"
    first = _torchtitan(folder, *toml, *shape, "--training.steps=2", f"--job.dump_folder={theirs}")
    assert sorted(first) == [1, 2] and first[1] > 7
    ours = folder / "ours"
    shutil.copytree(theirs / "checkpoint" / "step-2", ours / "checkpoint" / "step-2")  # a torchtitan dump folder's
    # torchtitan's own resume, and this recipe's with torchtitan's batch of 8 sequences, 4 on each of 2 ranks.
    here = [*shape, "--training.steps=5", "--checkpoint.interval=3", "--training.global_batch_size=8",
            "--training.local_batch_size=4", f"--data.cache_folder={folder / 'cache'}"]  # fmt: skip
    continued, proc = two_at_a_time(
        lambda: _torchtitan(folder, *toml, *shape, "--training.steps=5", f"--job.dump_folder={theirs}"),
        # From the user's folder, no PYTHONPATH: train.py finds its own modules.
        lambda: torchrun(
            REPO / "train.py", *toml, *here, f"--job.dump_folder={ours}", nproc=2, cwd=folder, env={"PYTHONPATH": ""}
        ),  # fmt: skip
    )
    assert sorted(continued) == [3, 4, 5]
    assert (
        f"resumed from torchtitan's checkpoint {ours / 'checkpoint' / 'step-2'} (afresh: spike_window)" in proc.stdout
    )
    assert "data: torchtitan's loader position is not read; reading on from sample 16 of data.path" in proc.stdout
    assert "learning rate is" not in proc.stdout  # the schedules agree
    rows = [json.loads(line) for line in (ours / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in rows if "tps" in r}
    assert sorted(resumed) == [3, 4, 5] and _close(resumed, continued, range(3, 6)), (resumed, continued)
    # Out: step 3 of this recipe as torchtitan's checkpoint; torchtitan resumes from it.
    back = folder / "back"
    step3 = back / "checkpoint" / "step-3"
    proc = python(str(REPO / "scripts" / "convert_torchtitan.py"), str(ours / "checkpoint" / "step-3"), str(step3),
                  "--config", "debug_model.toml", *here, cwd=folder)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].startswith(f"wrote {step3}"), proc.stderr
    again = _torchtitan(folder, *toml, *shape, "--training.steps=5", f"--job.dump_folder={back}")
    assert sorted(again) == [4, 5] and _close(again, resumed, range(4, 6)), (again, resumed)


def test_what_torchtitans_checkpoint_says_is_read_and_what_disagrees_is_one_line(tmp_path: Path) -> None:
    """A model and AdamW after a step, written in torchtitan's layout and read back into fresh ones: the same
    weights and moments (the permutation out and in undo each other), the step and settings; another lr for the
    next step is one line; Adam's state is refused in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from checkpoint import verify
    from checkpoint.torchtitan import FLAT, is_torchtitan, load_torchtitan, schedule_disagreement, torchtitan_state_dict
    from errors import ConfigError

    fam = family("llama3")
    args = fam.flavors["debugmodel"]

    def built() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = fam.model_cls(args)
        with torch.no_grad():
            model.init_weights()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    model, opt = built()
    model(torch.randint(0, args.vocab_size, (2, 16))).float().square().mean().backward()
    opt.step()
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    group = {k.removeprefix("param_groups.tok_embeddings.weight."): v for k, v in flat.items()
             if k.startswith("param_groups.tok_embeddings.weight.")}  # fmt: skip
    optimizer = {k: v for k, v in flat.items() if k.startswith("state.")} | {
        f"param_groups.{k}": v for k, v in group.items()
    }

    def write(path: Path, **changes: object) -> Path:
        state = torchtitan_state_dict(
            dict(model.state_dict()), optimizer | changes, family=fam, args=args, step=1, lr=1e-3, next_lr=5e-4,
            tokens_per_rank=32, loader=None,
        )  # fmt: skip
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
        return path

    path = write(tmp_path / "step-1")
    metadata = verify(path)
    assert is_torchtitan(metadata)
    fresh, fresh_opt = built()
    state = load_torchtitan(path, metadata, fresh, fresh_opt, family=fam, args=args, key="checkpoint.folder")
    assert state.step == 1 and state.next_lr == 5e-4 and state.adamw
    assert state.settings == {"optimizer.lr": 1e-3, "optimizer.beta1": 0.9, "optimizer.beta2": 0.95,
                              "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.1}  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    wq = dict(model.named_parameters())["layers.0.attention.wq.weight"]
    fresh_wq = dict(fresh.named_parameters())["layers.0.attention.wq.weight"]
    assert torch.equal(opt.state[wq]["exp_avg_sq"], fresh_opt.state[fresh_wq]["exp_avg_sq"])
    assert schedule_disagreement(state, lr=5e-4) is None
    assert schedule_disagreement(state, lr=4e-4) == (
        "resume: step 2's learning rate is 0.0004 here and was 0.0005 in the torchtitan run that saved the checkpoint "
        "(lr_scheduler.* or training.steps differ from its; this run's schedule wins)"
    )
    adam = write(tmp_path / "adam", **{"param_groups.decoupled_weight_decay": False})
    with pytest.raises(ConfigError, match=r"was trained by torchtitan with Adam .* does not carry over; start from"):
        load_torchtitan(adam, verify(adam), *built(), family=fam, args=args, key="checkpoint.folder")
    # Muon cannot continue AdamW's moments: one line that names both ways on, nothing loaded.
    from checkpoint import CheckpointManager, ModelInterop
    from config import Checkpoint, Optimizer
    from muon import build_muon

    muon_model = built()[0]
    manager = CheckpointManager(
        Checkpoint(enable=True), dump_folder=str(tmp_path), model=muon_model,
        optimizer=build_muon(Optimizer(name="Muon"), muon_model, fam), stateful={}, interop=ModelInterop(fam, args),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r'with AdamW\'s state, and optimizer.name is "Muon": set checkpoint.exclude'):
        manager._resume_torchtitan(path, metadata, excluded=set(), model_only=False)
