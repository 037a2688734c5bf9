"""The dead-letter reasons: the closed vocabulary of the `sao-dlq-reason` header.

Every writer of a dead letter names one of these; its value is the header's bytes, the label of
`sao_dlq_messages_total` and the key of the reason counts in progress files and reports.
docs/wire-format.md lists the same codes (tests/test_wire_doc.py keeps the two equal).
"""

from __future__ import annotations

from enum import StrEnum


class DeadLetterReason(StrEnum):
    """Why a message went to the dead-letter topic instead of being used."""

    # Any reader: the bytes are not a message of the kind the topic carries.
    DECODE_ERROR = "decode-error"
    SCHEMA_VERSION = "schema-version"
    WRONG_KIND = "wrong-kind"
    INVALID_FIELD = "invalid-field"
    # Too large for its reader's limit: a task's bytes or context, a trajectory's bytes or rows.
    TOO_LARGE = "too-large"
    WRONG_ENV = "wrong-env"
    # A sampler, for a task.
    INVALID_TASK = "invalid-task"
    ENV_ERROR = "env-error"
    ENV_TIMEOUT = "env-timeout"
    VERSION_NOT_LOADED = "version-not-loaded"
    # The trainer, for a trajectory.
    TOO_STALE = "too-stale"
    FUTURE_VERSION = "future-version"
    INVALID_TOKEN = "invalid-token"
    INVALID_MEMORY = "invalid-memory"
    EMPTY_CONTEXT = "empty-context"
    NON_FINITE = "non-finite"
    OUT_OF_RANGE = "out-of-range"
    SCORING_ERROR = "scoring-error"
    NON_FINITE_LOSS = "non-finite-loss"
    NON_FINITE_GRADIENT = "non-finite-gradient"


# What a reader shows for a dead letter whose header names no reason (written by something other than sao).
NO_REASON = "no-reason"
