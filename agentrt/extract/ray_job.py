"""`agentrt extract --ray`: the same extraction job as a Ray Data pipeline (read -> map_batches over
engine actors -> write), for a cluster of machines (or several engines on one).

    agentrt extract --input docs.jsonl --output out.jsonl --schema s.json --ray --num-workers 4
    agentrt extract ... --ray --ray-address ray://HEAD:10001 --num-workers 8 [--cpus-per-worker 4]

The pipeline (Ray Data, https://docs.ray.io/en/latest/data/api/doc/ray.data.Dataset.map_batches.html):

- read: the driver streams the input through the job's own reader (agentrt/extract/reader.py and
  job.job_inputs: ids, "#N" for rows without one, duplicates, bad lines as error rows, ids already
  in the output skipped) and puts the rows still to do into Ray's object store as Arrow blocks
  (`ray.data.from_arrow_refs`), one block of `block_rows` rows at a time. So the input file need
  only be readable by the driver, every row means exactly what it means in-process, and the driver
  holds one block in memory; the object store holds the pending documents' text (spilling to disk
  beyond its size).
- map_batches: a fixed pool of `num_workers` `EngineWorker` actors (`concurrency=num_workers`), each
  holding an in-process engine (`Engine(config)`, as `LLM.from_config` builds it) and running each block through
  agentrt/extract/batch.py's `run_batch`, the driver of `LLM.extract_batch`, so a row is the row
  the in-process job writes (greedy outputs are token-identical in any batch composition). CPU
  actors reserve `num_cpus=cpus_per_worker` each and run torch with that many threads
  (torch.set_num_threads and OMP_NUM_THREADS); GPU actors reserve `num_gpus=1` each.
- write: result blocks stream back to the driver (`iter_batches`, completion order) and the driver
  writes each row through the job's `OutputWriter` (job.run_job), so resume, exactly-once and
  torn-line repair hold as in-process, and the summary is the same. A block's rows arrive when
  the block is done: a job killed part-way loses at most the blocks in flight, never a row twice.

Ray is an optional extra (`pip install "agentrt[ray]"`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from agentrt.extract.types import ExtractInput, ExtractResult, Usage

RAY_INSTALL_HINT = '--ray needs Ray Data, which is not installed: `pip install "agentrt[ray]"` (or `pip install "ray[data]"`)'


def import_ray():
    """The `ray` module with Ray Data. Raises ImportError with RAY_INSTALL_HINT when it is missing."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise ImportError(RAY_INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class RayJobOptions:
    """How the job runs on Ray. num_workers: engine actors; cpus_per_worker: CPUs each CPU actor
    reserves and its torch threads (None: the cluster's CPUs / num_workers); address: the cluster
    (None: RAY_ADDRESS, a running local cluster, or a new local one); block_rows: rows per block at
    most (None: 4 x the in-flight window, so an actor's engine stays full but for each block's tail)."""

    num_workers: int = 1
    cpus_per_worker: int | None = None
    address: str | None = None
    block_rows: int | None = None


@dataclass(frozen=True)
class WorkerPlan:
    """What each actor runs: the engine config, the job's schemas (name -> schema; None: the one
    schema), the SamplingParams of every document (as the in-process job builds them), the in-flight
    window, prompt template, confidence threshold, and its thread budget (CPU actors; None on GPUs)."""

    config: Any
    schemas: dict
    params: Any
    max_in_flight: int | None
    prompt: Any
    min_confidence: float | None
    num_threads: int | None


class EngineWorker:
    """A Ray Data actor (a callable class for `map_batches`) holding one in-process engine.

    Construction loads the model and compiles every schema of the job (a ConstraintError fails the
    actor; the driver checks the same schemas before the job starts, see `check_schemas`). Each
    call takes a block {"index": int64[n], "input": str[n]} (the JSON of `encode_input`) and returns
    {"result": str[n]}, the JSON of each ExtractResult (`encode_result`), in completion order."""

    def __init__(self, plan: WorkerPlan):
        if plan.num_threads is not None:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(plan.num_threads)
            torch.set_num_threads(plan.num_threads)
        from agentrt.extract.batch import SchemaRegistry
        from agentrt.runtime.engine import Engine

        self.plan = plan
        self.engine = Engine(plan.config)
        self.registry = SchemaRegistry(self.engine)
        for schema in plan.schemas.values():
            self.registry.require(schema)
        self.params = plan.params

    def __call__(self, block: dict) -> dict[str, list[str]]:
        from agentrt.extract.batch import run_batch
        from agentrt.runtime.chat_template import chat_prompt_ids

        indices = [int(i) for i in block["index"]]
        inputs = [decode_input(s, self.plan.schemas) for s in block["input"]]
        results = run_batch(
            self.engine,
            partial(chat_prompt_ids, self.engine.tokenizer),
            inputs,
            None,
            sampling_params=self.params,
            max_in_flight=self.plan.max_in_flight,
            prompt=self.plan.prompt,
            min_confidence=self.plan.min_confidence,
            registry=self.registry,
        )
        out = []
        for r in results:
            r.index = indices[r.index]  # the position in the job's inputs, not in this block
            out.append(encode_result(r))
        return {"result": out}


def encode_input(inp: ExtractInput) -> str:
    """One input as JSON for the pipeline: its schema travels by name (the actors hold the schemas),
    so a block carries only text, id, error, gold and schema name."""
    return json.dumps(
        {"text": inp.text, "id": inp.id, "error": inp.error, "gold": inp.gold, "schema_name": inp.schema_name}
    )


def decode_input(data: str, schemas: dict) -> ExtractInput:
    """`encode_input`'s inverse, the schema looked up by name (None: the job's one schema)."""
    d = json.loads(data)
    inp = ExtractInput(d["text"], d["id"], error=d["error"], gold=d["gold"], schema_name=d["schema_name"])
    if inp.error is None:
        inp.schema = schemas.get(inp.schema_name)
    return inp


def encode_result(r: ExtractResult) -> str:
    """An ExtractResult as JSON (every field; `decode_result` rebuilds it equal)."""
    return json.dumps(dataclasses.asdict(r))


def decode_result(data: str) -> ExtractResult:
    d = json.loads(data)
    d["usage"] = Usage(**d["usage"])
    return ExtractResult(**d)


def check_schemas(config, schemas: dict, args_name: str | None) -> int:
    """Compile every schema with the model's tokenizer on the driver (no weights loaded), as the
    in-process job does before it starts: the same ConstraintError text (keyword + JSON pointer),
    raised as ValueError naming the schema. Returns the model's vocabulary size."""
    from agentrt.extract.batch import SchemaRegistry
    from agentrt.grammars.xgrammar_backend import GrammarBackend
    from agentrt.runtime.models.loader import load_tokenizer, resolve_model_dir
    from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config

    model_dir = resolve_model_dir(config.model.model, config.model.cache_dir)
    hf_config = read_hf_config(model_dir)
    vocab_size = arch_from_hf_config(hf_config).vocab_size
    loaded = load_tokenizer(model_dir, hf_config, vocab_size)
    backend = GrammarBackend(loaded.tokenizer, vocab_size, loaded.stop_ids, config.grammar)
    try:
        registry = SchemaRegistry(types.SimpleNamespace(grammar=backend))
        for name, schema in schemas.items():
            try:
                registry.require(schema)
            except ValueError as e:
                raise ValueError(f"schema {name or args_name}: {e}") from None
    finally:
        backend.shutdown()
    return vocab_size


def blocks(rows: Iterable[str], block_rows: int, num_workers: int) -> Iterator[list[tuple[int, str]]]:
    """(index, row) lists of at most `block_rows` rows, streamed; a job smaller than one full block
    per worker is split evenly over the workers instead (so every actor gets work). Raises
    ValueError for block_rows or num_workers < 1."""
    if block_rows < 1 or num_workers < 1:
        raise ValueError(f"block_rows and num_workers must be >= 1, got {block_rows}, {num_workers}")
    head: list[tuple[int, str]] = []
    it = enumerate(rows)
    for item in it:
        head.append(item)
        if len(head) == block_rows * num_workers:
            break
    else:  # the whole job fits in one block per worker
        if head:
            size = math.ceil(len(head) / num_workers)
            for k in range(0, len(head), size):
                yield head[k : k + size]
        return
    for k in range(0, len(head), block_rows):
        yield head[k : k + block_rows]
    block: list[tuple[int, str]] = []
    for item in it:
        block.append(item)
        if len(block) == block_rows:
            yield block
            block = []
    if block:
        yield block


def _resources(ray, config, opts: RayJobOptions) -> tuple[dict[str, Any], int | None]:
    """map_batches resource arguments of each actor and its thread budget (None on GPUs). Raises
    ValueError when the cluster cannot hold the workers asked for."""
    total = ray.cluster_resources()
    gpus, cpus = total.get("GPU", 0), int(total.get("CPU", 0))
    device = config.model.device
    if device.startswith("cuda") or (device == "auto" and gpus > 0):
        if gpus < opts.num_workers:
            raise ValueError(
                f"--num-workers {opts.num_workers} on GPUs needs a GPU per worker; the Ray cluster has {gpus:g}"
            )
        return {"num_gpus": 1, "num_cpus": 1}, None
    per = opts.cpus_per_worker or max(1, cpus // opts.num_workers)
    if per * opts.num_workers > cpus:
        raise ValueError(
            f"--num-workers {opts.num_workers} x {per} CPUs per worker exceeds the Ray cluster's {cpus} CPUs "
            "(lower --num-workers or --cpus-per-worker)"
        )
    return {"num_cpus": per, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(per)}}}, per


def ray_driver(config, plan_args: WorkerPlan, opts: RayJobOptions, args_name: str | None = None):
    """The --ray driver for `job.run_job`: `results_of(inputs)` -> ExtractResults in completion order.

    Before it returns, the schemas are compiled on the driver (`check_schemas`) and the sampling
    values validated, then Ray is started (or joined: an initialised Ray is used as is and left
    running) and the actors' resources planned. Raises ImportError (Ray missing, RAY_INSTALL_HINT),
    ValueError (a schema that cannot be compiled or enforced, invalid sampling values, more workers
    than the cluster holds), ConnectionError (no cluster at `opts.address`)."""
    ray = import_ray()
    if opts.num_workers < 1:
        raise ValueError(f"--num-workers must be >= 1, got {opts.num_workers}")
    if opts.cpus_per_worker is not None and opts.cpus_per_worker < 1:
        raise ValueError(f"--cpus-per-worker must be >= 1, got {opts.cpus_per_worker}")
    vocab_size = check_schemas(config, plan_args.schemas, args_name)
    plan_args.params.validate(vocab_size)
    started = not ray.is_initialized()
    if started:
        ray.init(address=opts.address, include_dashboard=False, logging_level="WARNING")
    try:
        remote_args, threads = _resources(ray, config, opts)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    plan = dataclasses.replace(plan_args, num_threads=threads)
    window = plan.max_in_flight or 2 * config.scheduler.max_num_seqs
    block_rows = opts.block_rows or 4 * window

    def results_of(inputs: Iterable[ExtractInput]) -> Iterator[ExtractResult]:
        import pyarrow as pa

        try:
            refs = [
                ray.put(pa.table({"index": [i for i, _ in b], "input": [s for _, s in b]}))
                for b in blocks((encode_input(inp) for inp in inputs), block_rows, opts.num_workers)
            ]
            if not refs:
                return
            ray.data.DataContext.get_current().enable_progress_bars = False  # the job has its own
            ds = ray.data.from_arrow_refs(refs).map_batches(
                EngineWorker,
                batch_size=None,  # one block, one call: the blocks are already sized
                batch_format="numpy",
                concurrency=opts.num_workers,
                fn_constructor_kwargs={"plan": plan},
                **remote_args,
            )
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                for data in batch.column("result").to_pylist():
                    yield decode_result(data)
        finally:
            if started:
                ray.shutdown()

    return results_of
