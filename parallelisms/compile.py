"""torch.compile per transformer block, with an inductor cache keyed on the recipe.

Why a keyed cache directory (docs/failures.md #4): before PyTorch 2.8 inductor's FX graph cache key
left out private inductor configs (names starting with "_"), among them `_micro_pipeline_tp`,
the async-TP switch. A plain-TP run could then be served a graph compiled for async TP and fail
with "'symm_mem' object has no attribute 'fused_all_gather_matmul'" (pytorch/torchtitan #1185).
PyTorch 2.8 made private inductor configs part of the FX graph cache key (pytorch/pytorch PR
#153672). A directory per recipe keeps different recipes apart on any PyTorch version, and
also from each other's autotuning and Triton kernels.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

_RECIPE_DIR = re.compile(r"recipe-[0-9a-f]{16}")


def inductor_cache_dir(
    recipe: Mapping[str, str | int | bool], *, torch_version: str = torch.__version__, root: str | Path | None = None
) -> Path:
    """`root/recipe-<hash>`: one inductor cache per recipe, i.e. per set of settings that change generated code.

    recipe: those settings by name (built in parallelize_model, the one place that lists them); the PyTorch
        version is added here. root: where the per-recipe folders live; default: the TORCHINDUCTOR_CACHE_DIR
        the user set (without a recipe folder this function appended earlier), else inductor's default.
    """
    key = json.dumps({**recipe, "torch": torch_version}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _cache_root(root) / f"recipe-{digest}"


def _cache_root(root: str | Path | None) -> Path:
    if root is not None:
        return Path(root)
    # Importing torch._dynamo already writes inductor's default into the variable, so it is
    # usually set; a recipe folder at its end is ours (from an earlier call in this process).
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current:
        path = Path(current)
        return path.parent if _RECIPE_DIR.fullmatch(path.name) else path
    return Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"


def use_inductor_cache_dir(path: str | Path) -> None:
    """Point inductor (and Triton) at `path` for everything compiled from now on in this process.

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks up or writes a cache entry, not once
    at import (checked on PyTorch 2.13: `torch._inductor.runtime.cache_dir_utils.cache_dir()`), so
    setting it before the first compiled call is enough. Triton's kernel cache would otherwise
    default to a shared folder when TRITON_CACHE_DIR is set globally; pin it under the recipe too.
    """
    path = Path(path).resolve()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")


def apply_compile(model: nn.Module, *, backend: str = "inductor", cache_dir: str | Path | None = None) -> None:
    """Compile each transformer block in place (`Module.compile`), one graph per block.

    Per block rather than the whole model: all blocks share one compiled graph (same code, weights
    as inputs), compile time does not grow with depth, and the FSDP hooks between blocks are
    not traced. `Module.compile` keeps parameter names (no `_orig_mod.` prefix). fullgraph=True
    turns a graph break inside a block into an error instead of a silent slowdown. A fully checkpointed block
    compiles its forward inside the checkpoint (`parallelisms.ac.CheckpointedModule.compile`).
    backend: torch.compile's (aot_eager or eager to tell a compiler problem from a model problem).
    cache_dir: the `inductor_cache_dir(...)` of this recipe; None keeps the current cache.
    """
    if cache_dir is not None:
        use_inductor_cache_dir(cache_dir)
    for block in model.layers.values():
        block.compile(fullgraph=True, backend=backend)
