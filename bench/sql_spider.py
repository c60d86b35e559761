"""SQL generation on Spider (issue 15): the 50 dev questions of ../shared/testdata/sql on their
SQLite databases (schema only, no rows), the default model, greedy, three configurations side by
side in one run: unconstrained, the generic Lark SQL grammar of ../shared/testdata/sql
(syncode_sql_grammar.lark) and agentrt's schema-aware grammar (agentrt/sql/).

Per configuration: queries that parse (sqlglot, SQLite), that run on the database without error,
that name only existing tables and columns, exact-set match with the gold query (both rewritten by
agentrt.sql.validate.normalize, then compared as sqlglot expressions with the SELECT items, the
AND-ed conditions and the GROUP BY items as sets: a simplified form of Spider's exact-set match),
finished (stop) vs cut by max_tokens, tokens/s (all 50 generated as one batch), and the
schema-aware grammar's compile time per database.

    python bench/sql_spider.py [--max-tokens 128] [--limit 50]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.request import SamplingParams
from agentrt.sdk import LLM
from agentrt.sql.grammar import sql_grammar
from agentrt.sql.introspect import introspect, open_database
from agentrt.sql.service import sql_messages
from agentrt.sql.validate import QueryError, execute, normalize, validate

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "testdata" / "sql"


def extract_sql(text: str) -> str:
    """The query in an unconstrained answer: a ```sql block's body, else the text from the first
    SELECT/WITH, up to the first semicolon."""
    fence = re.search(r"```(?:sql)?\s*(.*?)(```|$)", text, re.DOTALL | re.IGNORECASE)
    if fence:
        text = fence.group(1)
    start = re.search(r"\b(SELECT|WITH)\b", text, re.IGNORECASE)
    text = text[start.start() :] if start else text
    return text.split(";", 1)[0].strip()


def _canonical(query: str, schema) -> str | None:
    """The query as a sqlglot expression with order-free parts sorted (None: it does not parse or
    names what the schema lacks)."""
    import sqlglot
    from sqlglot import exp

    try:
        tree = sqlglot.parse_one(normalize(query, schema, "sqlite"), read="sqlite")
    except (QueryError, sqlglot.errors.SqlglotError):
        return None
    for select in tree.find_all(exp.Select):
        select.set("expressions", sorted(select.expressions, key=lambda e: e.sql()))
        group = select.args.get("group")
        if group is not None:
            group.set("expressions", sorted(group.expressions, key=lambda e: e.sql()))
    for where in tree.find_all(exp.Where):
        conds = list(where.this.flatten()) if isinstance(where.this, exp.And) else [where.this]
        where.set("this", exp.and_(*sorted(conds, key=lambda e: e.sql())))
    return tree.sql(dialect="sqlite").lower()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--show", action="store_true", help="print every query that did not run")
    ap.add_argument(
        "--generic-limit",
        type=int,
        default=None,
        help="questions for the generic Lark grammar (default: all; its masks cost ~0.7 s per row per "
        "step on 2 cores, so its 50 take over an hour)",
    )
    ap.add_argument(
        "--configs",
        default="unconstrained,close,length,generic",
        help="configurations to run, comma-separated (unconstrained, close, length, generic)",
    )
    args = ap.parse_args()
    rows = [json.loads(x) for x in (SHARED / "spider_dev_sample50.jsonl").read_text().splitlines()][
        : args.limit
    ]
    engines, schemas = {}, {}
    for r in rows:
        if r["db_id"] not in engines:
            engines[r["db_id"]] = open_database(
                f"sqlite:///{SHARED / 'databases' / (r['db_id'] + '.sqlite')}"
            )
            schemas[r["db_id"]] = introspect(engines[r["db_id"]])
    # every database's grammar stays cached (up to ~10 MB each) and a compile may wait its turn:
    # the runs below submit each grammar's requests at once
    llm = LLM(grammar=GrammarConfig(compile_timeout_s=600, compile_queue_timeout_s=3600, cache_bytes=2 << 30))
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{len(rows)} questions over {len(engines)} databases, greedy, max_tokens {args.max_tokens}")

    # compile times (first compile of each grammar, through the backend: its cache then serves the runs)
    backend = llm.engine.grammar
    compile_s, specs = {}, {}
    for db, schema in schemas.items():
        t0 = time.perf_counter()
        g = sql_grammar(schema, "sqlite")
        gen_s = time.perf_counter() - t0
        specs[db] = g.spec()
        t0 = time.perf_counter()
        backend.compile(specs[db])
        compile_s[db] = (gen_s, time.perf_counter() - t0, len(g.ebnf))
    generic = ConstraintSpec.lark((SHARED / "syncode_sql_grammar.lark").read_text())
    t0 = time.perf_counter()
    backend.compile(generic)
    generic_compile_s = time.perf_counter() - t0

    print("\ncompile (first, uncached): generic Lark SQL grammar", f"{generic_compile_s:.2f} s")
    print("| database | tables | columns | grammar bytes | grammar build s | compile s |")
    print("|---|---|---|---|---|---|")
    for db, (gen_s, comp_s, size) in compile_s.items():
        s = schemas[db]
        print(f"| {db} | {len(s.tables)} | {s.num_columns} | {size:,} | {gen_s:.2f} | {comp_s:.2f} |")
    print(
        f"compile s: median {statistics.median(c[1] for c in compile_s.values()):.2f}, "
        f"max {max(c[1] for c in compile_s.values()):.2f}"
    )

    # the generic grammar last: its masks cost the most (over a second per step at batch 50), so a
    # long run has printed the other rows first
    configs = {
        "unconstrained": (None, "length"),
        "schema-aware grammar, max_tokens_policy close": ("schema", "close"),
        "schema-aware grammar": ("schema", "length"),
        "generic Lark SQL grammar": ("generic", "length"),
    }
    keys = dict(zip(["unconstrained", "close", "length", "generic"], configs))
    wanted = [c for c in args.configs.split(",") if c]
    unknown = [c for c in wanted if c not in keys]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}: choose from {sorted(keys)}")
    configs = {keys[c]: configs[keys[c]] for c in keys if c in wanted}
    print(
        "\n| configuration | parse | run without error | only existing tables/columns | exact-set match | "
        "finished (stop) | tokens | wall s | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, (kind, policy) in configs.items():
        requests = []
        subset = rows[: args.generic_limit] if kind == "generic" and args.generic_limit else rows
        for r in subset:
            schema = schemas[r["db_id"]]
            ids = llm._chat_ids(sql_messages(r["question"], schema, "sqlite"))
            spec = None if kind is None else generic if kind == "generic" else specs[r["db_id"]]
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, max_tokens_policy=policy)
            requests.append((ids, params, spec))
        t0 = time.perf_counter()
        outs = llm._run(requests)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        stats = {"parse": 0, "run": 0, "names": 0, "match": 0, "stop": 0}
        for r, out in zip(subset, outs):
            schema, engine = schemas[r["db_id"]], engines[r["db_id"]]
            query = extract_sql(out.text) if kind is None else out.text.strip()
            stats["stop"] += out.finish_reason == "stop"
            check = validate(query, schema, "sqlite")
            stats["parse"] += check.ok or check.stage not in ("parse", "read_only")
            stats["names"] += check.ok
            try:
                execute(query, engine, schema, max_rows=1)
                stats["run"] += 1
            except QueryError as e:
                if args.show:
                    print(f"[{name}] {out.finish_reason}: {query[:300]!r} -- {str(e)[:120]}")
            gold = _canonical(r["query"], schema)
            stats["match"] += gold is not None and _canonical(query, schema) == gold
        st, n = stats, len(subset)
        print(
            f"| {name} | {st['parse']}/{n} | {st['run']}/{n} | {st['names']}/{n} | {st['match']}/{n} | "
            f"{st['stop']}/{n} | {tokens} | {wall:.1f} | {tokens / wall:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
