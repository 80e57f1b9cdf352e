"""lm-eval's tasks, found and their data checked before anything is scored, for eval.py --tasks and the in-loop
eval alike: lm-eval's index of its tasks (`task_manager`, `task_manager_for`: include_path's own alone when it holds
them all), the hub datasets this machine has no copy of (`uncached_hub_datasets`, read without that index), the hub's
offline mode while it does not answer (`hub_offline_unless_it_answers`), and the one-line refusals of a dataset that
cannot be read. lm-eval is imported inside each function: it is an optional extra."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from errors import ConfigError


def not_loaded(error: OSError, names: str, *, offline: str | None, key: str) -> ConfigError:
    """Why the datasets of tasks `names` could not be read (lm-eval's ConnectionError or OSError), in one line."""
    if isinstance(error, FileNotFoundError) and (missing := re.search(r"Unable to find '(.+?)'", str(error))):
        return ConfigError(
            f"{key}: {missing[1]}, a data file of {names}, does not exist (a task's relative data_files are read from "
            f"the current folder, {Path.cwd()}); start from the folder they are relative to, or fix the task's data_files"
        )
    return unreadable(names, why=f"not cached here, and {offline}" if offline else type(error).__name__, key=key)


def unreadable(names: str, *, why: str, key: str = "--tasks") -> ConfigError:
    return ConfigError(
        f"{key}: {names} needs its dataset, which could not be read ({why}); download it where the Hugging "
        "Face hub is reachable (HF_DATASETS_OFFLINE=0), or give a local task with --include-path"
    )


# A task's own YAML names it on a line of its own: `task: hellaswag`.
_TASK_LINE = re.compile(r"^task:[ \t]*['\"]?([^'\"\s#]+)['\"]?[ \t]*(?:#.*)?$", flags=re.M)


def uncached_hub_datasets(tasks: list[str], include_path: str | None) -> list[str]:
    """The hub datasets of `tasks` that this machine has no copy of, for use while the hub does not answer, found
    without lm-eval's index of its tasks (about 14,000 YAML files parsed: 12 s here; their text read: half a second):
    the YAML whose `task:` line names a task, read by lm-eval's own loader (its includes resolved), and its dataset
    opened as lm-eval opens it, offline. A task found otherwise (a group, a tag, a task class) or with data files of
    its own is left to lm-eval, which says the same once it has read its index."""
    import datasets
    import lm_eval.tasks

    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval 0.4.13's loader (private): without it, no early word
    except ImportError:
        return []
    roots = [Path(lm_eval.tasks.__file__).parent, *([Path(include_path)] if include_path else [])]
    found: dict[str, Path] = {}
    for root in roots:  # a later root's task replaces an earlier one's, as in lm-eval's index
        for path in sorted(root.rglob("*.yaml")):
            for name in _TASK_LINE.findall(path.read_text(encoding="utf-8", errors="replace")):
                if name in tasks:
                    found[name] = path
    missing = []
    for path in found.values():
        try:
            cfg = load_yaml(path, resolve_func=False)
        except Exception:  # (a YAML lm-eval's index would skip too)
            continue
        hub = cfg.get("dataset_path")
        if not isinstance(hub, str) or "class" in cfg or cfg.get("dataset_kwargs") or cfg.get("custom_dataset"):
            continue
        try:
            datasets.load_dataset_builder(hub, cfg.get("dataset_name"))
        except (ConnectionError, OSError):  # (offline: a dataset not cached)
            missing.append(hub)
    return missing


HUB_TIMEOUT_S = 5.0


@contextlib.contextmanager
def hub_offline_unless_it_answers(timeout_s: float = HUB_TIMEOUT_S) -> Iterator[str | None]:
    """The Hugging Face hub's offline mode while lm-eval reads its datasets, when the hub does not answer one request
    within timeout_s: else huggingface_hub retries each request five times, waiting longer each time (and longer still
    where connections time out), before the run fails. Offline, a cached dataset is read and a missing one fails at once.
    Yields why the hub is not used ("<its address> did not answer", "offline mode is on"), or None when it answered."""
    import datasets.config
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        yield "offline mode is on"
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception:  # no answer: no network, no name resolution, refused, timed out, a proxy's or TLS's error
        pass
    else:
        yield None
        return
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield f"{constants.ENDPOINT} did not answer"
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


@functools.cache
def task_manager(include_path: str | None) -> Any:
    """lm-eval's index of its tasks (thousands of YAML files: seconds to build), and those of include_path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def task_manager_for(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's index of the tasks: include_path's alone when it holds every one of `tasks` (a second), else with
    lm-eval's own (thousands of YAML files: seconds). The same YAML either way, so the same scores."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return task_manager(include_path)
