"""docs/new_model.md performed on a copy of the repo, so the guide cannot drift from the code: Qwen3's folder
copied as `mymodel` by the guide's own commands, registered where its steps 5 and 7 say, then the new family's
parity layouts (FSDP 2, TP 2: losses and weights against one process) and its TP collective count run there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from tests.launch import REPO, python, torchrun
from tests.parity_worker import STEPS

TOL = 1e-5  # tests/test_parallelisms.py's


def guide_commands(section: str) -> list[str]:
    """The shell lines of the first ```bash block after `section` in docs/new_model.md."""
    text = (REPO / "docs" / "new_model.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(section) :], re.S)
    assert block, f"docs/new_model.md: no bash block after {section!r}"
    return [line.strip() for line in block[1].splitlines() if line.strip()]


def edit(path: Path, anchor: str, added: str) -> None:
    """Insert `added` after the line holding `anchor` (which must be there once)."""
    text = path.read_text()
    assert text.count(anchor) == 1, (path, anchor)
    at = text.index("\n", text.index(anchor)) + 1
    path.write_text(text[:at] + added + text[at:])


def test_the_guide_adds_a_family_that_passes_its_parity_and_tp_count(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in filter(None, tracked.stdout.split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    # Step 1, as the guide writes it.
    commands = guide_commands("1. Copy the family closest to yours")
    assert commands[0] == "cp -r models/qwen3 models/mymodel", commands
    subprocess.run(["bash", "-euc", "\n".join(commands)], cwd=copy, check=True)
    assert 'name="mymodel"' in (copy / "models/mymodel/__init__.py").read_text()
    assert "models.qwen3" not in "".join(p.read_text() for p in (copy / "models/mymodel").glob("*.py"))
    # Step 5: the case arm and the name.
    init = copy / "models/__init__.py"
    init.write_text(
        init.read_text().replace(
            'NAMES = ("llama3", "qwen3", "olmo2", "qwen3_moe")',
            'NAMES = ("llama3", "qwen3", "olmo2", "qwen3_moe", "mymodel")',
        )
    )
    edit(
        init,
        "from models.olmo2 import FAMILY",
        '        case "mymodel":\n            from models.mymodel import FAMILY\n',
    )
    # Step 7: its tiny shape and parity layouts, and its row of the TP count.
    worker = copy / "tests/parity_worker.py"
    edit(worker, 'TINY_SHAPES = {"llama3": TINY', 'TINY_SHAPES["mymodel"] = TINY_QWEN3\n')
    edit(worker, '"olmo2_pp2": Layout(pp=2, family="olmo2"),',
         '    "mymodel_fsdp2": Layout(dp_shard=2, family="mymodel"),\n    "mymodel_tp2": Layout(tp=2, family="mymodel"),\n')  # fmt: skip
    edit(worker, "TP_STATISTICS = {", '    "mymodel": 0,\n')

    run, env = tmp_path / "parity", {"PYTHONPATH": str(copy)}
    run.mkdir()
    reference = python(str(copy / "tests/parity_worker.py"), str(run), "--reference", cwd=copy, env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    torchrun(copy / "tests/parity_worker.py", str(run), "mymodel_fsdp2", "mymodel_tp2", nproc=2, cwd=copy, env=env)
    for layout in ("mymodel_fsdp2", "mymodel_tp2"):
        result = json.loads((run / f"{layout}.json").read_text())
        assert len(result["losses"]) == STEPS and result["param_types"] == ["DTensor"], result
        assert result["max_loss_diff"] <= TOL and result["max_param_diff"] <= TOL, (layout, result)
    count = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_parallelisms.py", "-k", "tp_block and mymodel",
                   cwd=copy, env=env)  # fmt: skip
    assert count.returncode == 0 and "3 passed" in count.stdout, count.stdout[-3000:]  # its collectives, its values
