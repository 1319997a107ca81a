"""The base class of every error the user must fix: a config key, a data row, a checkpoint, the cluster.

``rlfleet`` prints such an error's message alone and exits with code 2 (``--debug`` or ``RLFLEET_DEBUG=1``
adds the traceback). Library callers catch the specific subclass: ``ConfigError``, ``DataError``,
``CheckpointError``, ``ClusterCapacityError``.
"""

from __future__ import annotations


class UserError(Exception):
    """An error whose message states what is wrong and what to change; shown without a traceback."""
