"""Extraction jobs: documents in, schema-valid JSON out (`agentrt extract`, `LLM.extract_batch`).

prompt.py      the default prompt and --prompt templates
types.py       ExtractInput / ExtractResult (one output row)
reader.py      streaming input rows (JSON Lines, CSV, Parquet)
writer.py      append-only, fsync'd, resumable JSON Lines output
validate.py    parse + jsonschema validation (format checking on)
confidence.py  per-field confidence from token logprobs
batch.py       the in-process driver (bounded in-flight window over the engine)
server.py      the same job against an OpenAI-compatible server (--server)
summary.py     the end-of-job summary (failures by reason, tokens/s, field accuracy)
job.py         the job loop (progress, Ctrl-C, exit status); the `agentrt extract` command over it is
               agentrt/commands/extract.py (this package never imports the SDK or a command)
"""

from agentrt.extract.prompt import SYSTEM_PROMPT, PromptTemplate, extraction_messages
from agentrt.extract.types import ExtractInput, ExtractResult, Usage

__all__ = ["SYSTEM_PROMPT", "ExtractInput", "ExtractResult", "PromptTemplate", "Usage", "extraction_messages"]
