"""Helpers of the SQL tests: awkward (a database with awkward identifiers, as DDL per dialect),
sampling (random sentences of a schema-aware SQL grammar), walks (random token walks through a
compiled grammar)."""
