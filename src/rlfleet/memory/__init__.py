"""Memory: what a run will need, what this machine has, and what a running process holds.

- :mod:`~rlfleet.memory.estimate`: the peak bytes of a training rank's passes from the model's shape (pure);
- :mod:`~rlfleet.memory.planner`: that estimate for a recipe on this machine, the token budgets resolved
  for the run (``resolve_batching``) and the refusal of a layout that does not fit (``ensure_fits``);
- :mod:`~rlfleet.memory.report`: ``rlfleet plan``, the layout and the estimate in text;
- :mod:`~rlfleet.memory.probes`: resident memory of this process, and handing freed memory back to the OS;
- :mod:`~rlfleet.memory.allocator`: which ``malloc`` a training process runs on (jemalloc where installed).

Nothing is imported here: the command line reads :mod:`~rlfleet.memory.allocator` before anything else
is loaded.
"""
