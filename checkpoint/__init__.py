"""The run's folder on disk: one run at a time, and distributed checkpoints (DCP) that nothing loses.

Layout: <dump_folder>/.lock names the run that owns the folder; <dump_folder>/<checkpoint.folder>/
step-<N>/ holds one DCP checkpoint: the model and optimizer (sharded as they are trained,
resharded on load, so a run saved on 4 ranks resumes on 2), the data loader position, the step,
the RNG state and the schedule settings.

Nothing half-written is ever resumed, and nothing complete is lost. A checkpoint is written to
`step-<N>.partial/`; DCP writes `.metadata` last (to a temporary name, then renamed) once every
rank has finished, so a `.partial` folder with `.metadata` is complete. Rank 0 renames it to
`step-<N>/` as soon as it sees that: right after a blocking save, at the first step after an
async save finished (`poll`, a `Future.done()` per step), or at the next start-up after a crash
(`prepare_dump_folder`), which also removes `.partial` debris. Pruning renames a step
`step-<N>.pruned` before deleting it, so a kill while it deletes leaves no half checkpoint under a
checkpoint's name; start-up removes the rest. Resume looks at `step-<N>/` folders only; when the newest fails `verify` (a filesystem damaged a file after it was complete),
start-up renames it `step-<N>.damaged`, warns, and resumes from the newest one that passes. A save that runs out of disk space removes its `.partial` and stops the run in one
line. Non-finite weights are never saved, and a checkpoint with non-finite weights is refused
when loaded. Pruning (`keep_latest_k`) never removes the seed checkpoint (step 0).

Nothing damaged is loaded. Every save records the size and xxh3_128 of each file it writes, hashed as DCP
writes it (checkpoint/checksums.py), in `checksums.json`, which lands before `.metadata`: so it is published with the
folder. Before a load, the ranks re-hash the files, each its share, and agree on the first damaged one
(`verify_contents`); a damaged newest checkpoint is set aside as above and the one before resumes, one the user
names is refused in one line, and a folder whose checkpoints are all damaged stops the run rather than start
it again from step 0. A checkpoint saved before checksums were recorded is checked by size, said once.
`python -m checkpoint verify PATH` checks a step folder, or every step of a checkpoint folder, without loading it.

A checkpoint torchtitan 0.2.2 wrote (its weights at the top level of the state dict) is recognised by its keys
and read by torchtitan.py: a resume takes its weights, AdamW state and step, and each stateful part
with a `load_torchtitan(state)` method what it can; initial_load_path its weights.

Loading runs no code from the checkpoint folder. DCP's `.metadata` is a pickle and DCP loads
non-tensor items with `torch.load(weights_only=False)`; `verify` first reads `.metadata` with an
unpickler that admits only DCP's metadata classes, loads every non-tensor item with
`torch.load(weights_only=True)`, and checks that every data file is there and long enough. Only
then does DCP read the folder.

The package: folder.py (the lock, complete and damaged steps, recovery after a crash, a full disk),
verify.py (the checks before a load), manager.py (CheckpointManager and the after-step save), hf_export.py
(weights in from a step, out as a Hugging Face folder), checksums.py, torchtitan.py (torchtitan 0.2.2's
layout) and __main__.py (`python -m checkpoint verify`). A save calls one optional hook, CheckpointManager's
`on_point`, at its named points: a drill holds a rank still at one to aim a kill there (fleet/faults.py,
scripts/chaos.py); the package knows nothing of how.
"""

from checkpoint.folder import DumpFolderLock, check_folder, prepare_dump_folder, refuse_folder_of_steps
from checkpoint.hf_export import HF_SIDE_FILES, MODEL_PREFIX, export_hf_folder, load_model_weights
from checkpoint.manager import CheckpointManager, ModelInterop, SaveStep, is_model_only, stager_reusable
from checkpoint.verify import check_holds, verify, verify_contents

__all__ = [
    "HF_SIDE_FILES",
    "MODEL_PREFIX",
    "CheckpointManager",
    "DumpFolderLock",
    "ModelInterop",
    "SaveStep",
    "check_folder",
    "check_holds",
    "export_hf_folder",
    "is_model_only",
    "load_model_weights",
    "prepare_dump_folder",
    "refuse_folder_of_steps",
    "stager_reusable",
    "verify",
    "verify_contents",
]
