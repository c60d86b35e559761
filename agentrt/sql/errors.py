"""The errors of the SQL package: `SchemaError` for a schema that cannot be read or used, and
`DatabaseUnreachableError` for a database that cannot be connected to or read. Both are
InvalidRequestErrors (so ValueErrors) with `param` None: the API layer names the request field.
Every module of agentrt.sql raises these; this module imports nothing of the package."""

from __future__ import annotations

from agentrt.errors import InvalidRequestError


class SchemaError(InvalidRequestError):
    """A schema cannot be read or used: unparsable DDL/JSON, no tables, a limit exceeded, an
    unsupported dialect, a grammar over its size limit. The message names the problem."""


class DatabaseUnreachableError(SchemaError):
    """The database could not be connected to or its catalog read (the driver's reason is in the
    message; the URL's password is never shown)."""
