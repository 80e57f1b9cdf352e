"""Evaluation: how good the model is, during training and after it.

    validation.py   `[validation]`: the held-out loss every `validation.freq` steps (Validator, ValidateStep);
                    eval.py's held-out loss of a checkpoint is the same Validator's
    downstream.py   `[eval]`: lm-eval tasks scored on the live model in the layout that trains it (EvalStep,
                    build_downstream, ShardedScores)
    adapter.py      RecipeLM, lm-evaluation-harness's model interface over this repo's model (eval.py --tasks in one
                    process, downstream.py over a run's layout)
    tasks.py        lm-eval's tasks found and their data checked before anything is scored
    watch.py        `eval.py --watch RUN_FOLDER`: its options and the file of its scores

Nothing is imported here: `import train` reads validation.py and downstream.py alone, and lm-eval (an optional extra)
only when a run or eval.py scores tasks. eval.py and generate.py stay at the root as commands; neither package module
imports generate.py (inference.py loads a checkpoint's model for both).
"""
