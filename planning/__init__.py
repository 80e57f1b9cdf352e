"""Planning a job before it runs, on any machine: the doctor (`python -m planning.doctor`: the pitfalls of a job on
its machines, memory fit included; train.py runs it at start-up), the dry run (`[comm] mode = "fake_backend"`:
rank 0's view of a job of $WORLD_SIZE ranks) and the memory estimator (`python -m planning.estimate_memory`).
docs/planning.md tells how to use them."""
