"""The `agentrt` subcommands' faces: argument parsing, printing and exit status, over the library.

The top floor: a command may import any package (api, sdk, runtime, sql, extract), and no package
of the library imports a command (tests/test_import_graph.py holds both). agentrt/cli.py is the
entry point and dispatches here.

check.py    `agentrt check MODEL` (and serve's check before load): runtime/models/check.py's findings
            with the chat template rendered as the API renders requests (api/template_check.py)
sql.py      `agentrt sql`: a question over a database -> one read-only query, through the SDK
extract.py  `agentrt extract`: a resumable extraction job (agentrt/extract/ is its library)
"""
