"""The error raised for unusable data: a missing file, a malformed row, a bad prompt template."""

from __future__ import annotations

from rlfleet.errors import UserError


class DataError(ValueError, UserError):
    """A dataset, row or prompt file that cannot be used as configured.

    The message names the file (and line or row where it applies), the problem and the fix.
    """
