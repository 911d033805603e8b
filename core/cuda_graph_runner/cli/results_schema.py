"""The one JSON schema of benchmark results: ``cuda-graph-runner bench --json/--format json``
and ``benchmarks/run.py`` write it; ``benchmarks/compare.py``, ``make_docs.py``,
``make_docs_extra.py`` and :mod:`cuda_graph_runner.cli.plot` read it (docs/cli.md, "JSON schema").

A document (``"schema": SCHEMA``) holds flat records, one per measurement, with the unit
in each field's name (``_ms`` milliseconds, ``_us`` microseconds, ``_s`` seconds, ``_mib``
MiB = 2**20 bytes)::

    {"schema": "cuda-graph-runner.results/3",
     "tool": "bench" | "benchmarks/run.py" | "benchmarks/hf_compare.py",
     "env": {"device": "cuda:0", "device_name": ..., "torch": ..., ...},
     "settings": {...}, "notes": ["..."],
     "timings": [TIMING, ...], "ratios": [RATIO, ...], "runners": [RUNNER, ...],
     "extra": {...}}

* TIMING (:data:`TIMING_FIELDS`): one method (``eager``, a backend label such as
  ``tc_piecewise:inductor``, or run.py's baselines ``hand_graph`` / ``reduce_overhead``)
  at one size of one model and phase: ``batch_size`` (decode) or ``num_tokens`` and
  ``requests`` (prefill), ``median_ms`` per step, and where measured the spread
  (``min_ms``, ``max_ms``, ``samples_ms``), the eager time measured next to it
  (``eager_ms``, ``speedup``) and the checks against eager (``tokens_match``,
  ``argmax_match``, ``max_abs_diff``, ``replayed``, ``replay_prepare_us``).
* RATIO (:data:`RATIO_FIELDS`): ``method`` time over ``reference`` time at one size, both
  from the same run (``median``, ``lo``, ``hi``; ``benchmarks/bench_summary.py``).
* RUNNER (:data:`RUNNER_FIELDS`): one captured runner: ``num_sizes``, ``capture_s``,
  ``compile_s``, ``graph_memory_mib``, ``replay_prepare_us``, ``run_stats``.
* ``extra``: what one tool alone records (run.py: ``host_probe_us`` and each model's
  machine state under ``extra.models[MODEL]``; bench with a real model: ``generations``,
  ``{backend, prompt, text, matches_eager, replayed}`` per prompt); free-form, never validated.

:func:`read` / :func:`from_json` validate a document and raise :class:`ResultsSchemaError`
naming the bad field (``timings[3].median_ms: expected a number or null, got 'fast'``).
A document of another schema is refused, naming its schema and the accepted one.
:func:`nested_view` gives the per-model tables the docs generators and ``compare.py``
print from.

Standard library only (the benchmark scripts that read results import no torch).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from ..config.exceptions import CudaGraphRunnerError

SCHEMA_VERSION = 3
SCHEMA = f"cuda-graph-runner.results/{SCHEMA_VERSION}"
TOOLS = ("bench", "benchmarks/run.py", "benchmarks/hf_compare.py")
PHASES = ("decode", "prefill")

_NUM = "number"
_NUM_OR_NULL = "number or null"
_INT = "int"
_STR = "str"
_BOOL = "bool"
_NUM_LIST = "list of numbers"
_INT_LIST = "list of ints"
_DICT = "object"
_PHASE = "phase"

#: ``{field: (kind, required)}`` of a timing record.
TIMING_FIELDS: Dict[str, Tuple[str, bool]] = {
    "model": (_STR, True),
    "phase": (_PHASE, True),
    "method": (_STR, True),
    "batch_size": (_INT, False),
    "num_tokens": (_INT, False),
    "requests": (_INT, False),
    "median_ms": (_NUM_OR_NULL, True),
    "min_ms": (_NUM_OR_NULL, False),
    "max_ms": (_NUM_OR_NULL, False),
    "samples_ms": (_NUM_LIST, False),
    "warmup_rounds": (_INT, False),
    "warmup_ms": (_NUM_LIST, False),
    "steady": (_BOOL, False),
    "gc_ms": (_NUM, False),
    "eager_ms": (_NUM_OR_NULL, False),
    "speedup": (_NUM_OR_NULL, False),
    "replayed": (_BOOL, False),
    "tokens_match": (_BOOL, False),
    "hf_match": (_BOOL, False),
    "argmax_match": (_BOOL, False),
    "within_tolerance": (_BOOL, False),
    "max_abs_diff": (_NUM_OR_NULL, False),
    "replay_prepare_us": (_NUM_OR_NULL, False),
}
#: ``{field: (kind, required)}`` of a ratio record.
RATIO_FIELDS: Dict[str, Tuple[str, bool]] = {
    "model": (_STR, True),
    "phase": (_PHASE, True),
    "method": (_STR, True),
    "reference": (_STR, True),
    "batch_size": (_INT, False),
    "num_tokens": (_INT, False),
    "median": (_NUM, True),
    "lo": (_NUM, True),
    "hi": (_NUM, True),
}
#: ``{field: (kind, required)}`` of a runner record.
RUNNER_FIELDS: Dict[str, Tuple[str, bool]] = {
    "model": (_STR, True),
    "phase": (_PHASE, True),
    "backend": (_STR, True),
    "num_sizes": (_INT, True),
    "sizes": (_INT_LIST, False),
    "capture_s": (_NUM_OR_NULL, False),
    "compile_s": (_NUM_OR_NULL, False),
    "graph_memory_mib": (_NUM_OR_NULL, False),
    "largest_alone_mib": (_NUM_OR_NULL, False),
    "pool_ratio": (_NUM_OR_NULL, False),
    "warmup": (_STR, False),
    "replay_prepare_us": (_NUM_OR_NULL, False),
    "run_stats": (_DICT, False),
    "piece_calls": (_DICT, False),
    "dynamo_compiles": (_INT, False),
}
RECORDS = {"timings": TIMING_FIELDS, "ratios": RATIO_FIELDS, "runners": RUNNER_FIELDS}


class ResultsSchemaError(CudaGraphRunnerError, ValueError):
    """A results document that does not follow :data:`SCHEMA`; the message names the
    source, the field (``timings[3].median_ms``), what it holds and what is accepted."""


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(kind: str, v: Any) -> bool:
    if kind == _NUM:
        return _is_num(v)
    if kind == _NUM_OR_NULL:
        return v is None or _is_num(v)
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == _STR:
        return isinstance(v, str)
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind == _NUM_LIST:
        return isinstance(v, list) and all(_is_num(x) for x in v)
    if kind == _INT_LIST:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if kind == _DICT:
        return isinstance(v, dict)
    if kind == _PHASE:
        return v in PHASES
    raise AssertionError(kind)


def _expected(kind: str) -> str:
    return f"one of {', '.join(PHASES)}" if kind == _PHASE else f"a {kind}" if kind != _INT else "an int"


def validate(doc: Any, source: str = "results") -> Dict[str, Any]:
    """Check ``doc`` against :data:`SCHEMA`; returns it.

    Raises:
        ResultsSchemaError: names ``source`` and the first bad field: a missing required
            field, a value of the wrong type, an unknown field in a record (a typo such as
            ``media_ms`` must not pass unnoticed), a record with neither or both of
            ``batch_size`` / ``num_tokens``, or another schema.
    """

    def bad(where: str, what: str) -> ResultsSchemaError:
        return ResultsSchemaError(f"{source}: {where}: {what}")

    if not isinstance(doc, dict):
        raise bad("the document", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise bad("schema", f"expected {SCHEMA!r}, got {doc.get('schema')!r}")
    if doc.get("tool") not in TOOLS:
        raise bad("tool", f"expected one of {', '.join(TOOLS)}, got {doc.get('tool')!r}")
    env = doc.get("env")
    if not isinstance(env, dict):
        raise bad("env", f"expected an object, got {env!r}")
    if not isinstance(env.get("device"), str):
        raise bad("env.device", f"expected a str (the torch device), got {env.get('device')!r}")
    for key in ("settings", "extra"):
        if not isinstance(doc.get(key, {}), dict):
            raise bad(key, f"expected an object, got {type(doc[key]).__name__}")
    notes = doc.get("notes")
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise bad("notes", "expected a list of str")
    for section, fields in RECORDS.items():
        records = doc.get(section)
        if not isinstance(records, list):
            raise bad(section, f"expected a list of records, got {type(records).__name__}")
        for i, rec in enumerate(records):
            where = f"{section}[{i}]"
            if not isinstance(rec, dict):
                raise bad(where, f"expected an object, got {rec!r}")
            for key, value in rec.items():
                if key not in fields:
                    raise bad(f"{where}.{key}", f"unknown field; known: {', '.join(fields)}")
                kind = fields[key][0]
                if not _check(kind, value):
                    raise bad(f"{where}.{key}", f"expected {_expected(kind)}, got {value!r}")
            for key, (_, required) in fields.items():
                if required and key not in rec:
                    raise bad(f"{where}.{key}", "missing (required)")
            if "batch_size" in fields and section != "runners":
                size_key = "batch_size" if rec["phase"] == "decode" else "num_tokens"
                other = "num_tokens" if size_key == "batch_size" else "batch_size"
                if size_key not in rec or other in rec:
                    raise bad(where, f"a {rec['phase']} record has {size_key} and no {other}")
    return doc


def document(
    tool: str,
    env: Mapping[str, Any],
    *,
    timings: Iterable[Mapping[str, Any]] = (),
    ratios: Iterable[Mapping[str, Any]] = (),
    runners: Iterable[Mapping[str, Any]] = (),
    notes: Iterable[str] = (),
    settings: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """A validated document of :data:`SCHEMA` (fields None are left out of records).

    Raises:
        ResultsSchemaError: a record breaks the schema (a bug of the writer).
    """

    def clean(recs: Iterable[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        return [{k: v for k, v in r.items() if v is not None or k == "median_ms"} for r in recs]

    doc = {
        "schema": SCHEMA,
        "tool": tool,
        "env": dict(env),
        "settings": dict(settings or {}),
        "notes": list(notes),
        "timings": clean(timings),
        "ratios": clean(ratios),
        "runners": clean(runners),
        "extra": dict(extra or {}),
    }
    return validate(doc, f"{tool} output")


# -- from the tools' tables ----------------------------------------------------------------------


def _size_field(phase: str) -> str:
    return "batch_size" if phase == "decode" else "num_tokens"


def from_bench_rows(old: Mapping[str, Any]) -> Dict[str, Any]:
    """A :data:`SCHEMA` document from the bench's rows: ``{"env", "runners", "decode",
    "prefill", "notes"}``, each row ``{batch_size | num_tokens, requests, backend,
    eager_ms, graph_ms, speedup, ...}``; the bench writes with it. A row of backend
    ``disabled`` (eager only) becomes an ``eager`` timing; any other row a timing of its
    backend whose ``eager_ms`` is the eager time measured next to it; a row timed in
    interleaved rounds (``speedup_lo``/``speedup_hi``, ``graph_samples_ms``:
    ``bench_measure.paired_ms``) also gives its samples and a ratio record of the backend
    over ``eager`` for decode (``median`` = 1 / speedup, ``lo``/``hi`` from the per-round
    speedups)."""
    env = dict(old.get("env") or {})
    model = str(env.get("model", "?"))
    timings = []
    ratios = []
    for phase in PHASES:
        for row in old.get(phase) or []:
            rec: Dict[str, Any] = {"model": model, "phase": phase}
            size = _size_field(phase)
            rec[size] = row.get(size)
            if phase == "prefill":
                rec["requests"] = row.get("requests")
            if row.get("backend") in (None, "disabled") or row.get("graph_ms") is None:
                timings.append({**rec, "method": "eager", "median_ms": row.get("eager_ms")})
                continue
            rec.update(method=row["backend"], median_ms=row.get("graph_ms"), eager_ms=row.get("eager_ms"))
            for key in (
                "speedup",
                "replayed",
                "tokens_match",
                "hf_match",
                "argmax_match",
                "within_tolerance",
                "max_abs_diff",
                "replay_prepare_us",
            ):
                rec[key] = row.get(key)
            samples = row.get("graph_samples_ms")
            if samples:
                rec.update(samples_ms=list(samples), min_ms=min(samples), max_ms=max(samples))
            # decode only: a ratio record has no field for a prefill row's request count
            if phase == "decode" and row.get("speedup") and row.get("speedup_lo") and row.get("speedup_hi"):
                ratios.append(
                    {
                        "model": model,
                        "phase": phase,
                        "method": row["backend"],
                        "reference": "eager",
                        size: row.get(size),
                        "median": 1.0 / row["speedup"],
                        "lo": 1.0 / row["speedup_hi"],
                        "hi": 1.0 / row["speedup_lo"],
                    }
                )
            timings.append(rec)
    runners = []
    for r in old.get("runners") or []:
        sizes = r.get("sizes") or []
        runners.append(
            {
                "model": model,
                "phase": r.get("phase"),
                "backend": r.get("backend"),
                "num_sizes": len(sizes),
                "sizes": sizes,
                "capture_s": r.get("capture_s"),
                "compile_s": r.get("compile_s"),
                "graph_memory_mib": r.get("graph_memory_mb"),
                "run_stats": r.get("run_stats"),
            }
        )
    extra = {"generations": old["generations"]} if old.get("generations") else None
    notes = old.get("notes") or []
    return document("bench", env, timings=timings, ratios=ratios, runners=runners, notes=notes, extra=extra)


#: run.py's capture keys; a prefill runner is ``"NAME (prefill)"`` there.
_CAPTURE_RENAMES = {"sizes": "num_sizes", "pool_mb": "graph_memory_mib", "largest_alone_mb": "largest_alone_mib"}
_RUN_SECTIONS = (
    "decode",
    "ratios",
    "prefill",
    "prefill_ratios",
    "capture",
    "replay_prepare_us",
    "max_abs_diff_vs_eager",
    "prefill_by_requests",
)


def from_run_models(
    models: Mapping[str, Any],
    env: Mapping[str, Any],
    *,
    settings: Optional[Mapping[str, Any]] = None,
    notes: Iterable[str] = (),
    host_probe_us: Optional[Mapping[str, Any]] = None,
    tool: str = "benchmarks/run.py",
) -> Dict[str, Any]:
    """A :data:`SCHEMA` document from benchmarks/run.py's per-model tables
    (``models[MODEL].decode[BS][METHOD]`` = timing cell, ``ratios[BS][METHOD][REF]``,
    ``prefill``, ``prefill_ratios``, ``capture[NAME]``, ``replay_prepare_us[NAME]``,
    ``max_abs_diff_vs_eager[NAME][BS]``, ``prefill_by_requests[R][TOKENS][METHOD]`` (the
    prefill cells of the run's other request counts, each cell with its ``requests``);
    other keys go to ``extra.models[MODEL]``: run.py's ``floor_ms``, ``device_rates``,
    ``prefill_requests``, machine state).
    run.py writes with it.

    Raises:
        ResultsSchemaError: a cell is not a timing object (names it), or a record breaks
            :data:`SCHEMA`.
    """
    timings: List[Dict[str, Any]] = []
    ratios: List[Dict[str, Any]] = []
    runners: List[Dict[str, Any]] = []
    extra_models: Dict[str, Any] = {}
    env = dict(env)
    if "device_name" not in env and env.get("gpu"):
        env["device_name"] = env["gpu"]
    for model, m in models.items():
        diffs = m.get("max_abs_diff_vs_eager") or {}
        for phase, ratio_key in (("decode", "ratios"), ("prefill", "prefill_ratios")):
            size = _size_field(phase)
            for x, methods in (m.get(phase) or {}).items():
                for method, cell in methods.items():
                    rec = {"model": model, "phase": phase, "method": method, size: int(x)}
                    if not isinstance(cell, dict):
                        raise ResultsSchemaError(
                            f"models.{model}.{phase}.{x}.{method}: expected a timing object "
                            f"{{'median_ms': ...}}, got {cell!r}"
                        )
                    rec.update(cell)
                    if phase == "decode" and str(x) in (diffs.get(method) or {}):
                        rec["max_abs_diff"] = diffs[method][str(x)]
                    timings.append(rec)
            sections = [m.get(phase) or {}]
            if phase == "prefill":  # the run's other request counts: cells carry "requests"
                sections += [rows for _, rows in sorted((m.get("prefill_by_requests") or {}).items())]
            for rows in sections[1:]:
                for x, methods in rows.items():
                    for method, cell in methods.items():
                        timings.append({"model": model, "phase": phase, "method": method, size: int(x), **cell})
            for x, methods in (m.get(ratio_key) or {}).items():
                for method, refs in methods.items():
                    for ref, stats in refs.items():
                        ratios.append(
                            {"model": model, "phase": phase, "method": method, "reference": ref, size: int(x), **stats}
                        )
        for name, cap in (m.get("capture") or {}).items():
            phase, backend = (
                ("prefill", name[: -len(" (prefill)")]) if name.endswith(" (prefill)") else ("decode", name)
            )
            rec = {"model": model, "phase": phase, "backend": backend}
            rec.update({_CAPTURE_RENAMES.get(k, k): v for k, v in cap.items()})
            rec["replay_prepare_us"] = (m.get("replay_prepare_us") or {}).get(name)
            runners.append(rec)
        rest = {k: v for k, v in m.items() if k not in _RUN_SECTIONS}
        if rest:
            extra_models[model] = rest
    extra: Dict[str, Any] = {}
    if extra_models:
        extra["models"] = extra_models
    if host_probe_us:
        extra["host_probe_us"] = dict(host_probe_us)
    return document(
        tool, env, timings=timings, ratios=ratios, runners=runners, notes=notes, settings=settings, extra=extra
    )


def from_json(doc: Any, source: str = "results") -> Dict[str, Any]:
    """``doc`` checked to be a document of :data:`SCHEMA` (:func:`validate`): how every
    reader takes a document.

    Raises:
        ResultsSchemaError: ``doc`` is not a JSON object, names another schema (the message
            names it and :data:`SCHEMA`), or breaks :data:`SCHEMA` (names the bad field).
    """
    if not isinstance(doc, dict):
        raise ResultsSchemaError(f"{source}: expected a JSON object of results, got {type(doc).__name__}")
    schema = doc.get("schema")
    if schema != SCHEMA:
        raise ResultsSchemaError(
            f"{source}: schema {schema!r} is not accepted; accepted: {SCHEMA!r} "
            "(write it with cuda_graph_runner.cli.results_schema.document, from_run_models or from_bench_rows)"
        )
    return validate(doc, source)


def read(path: str) -> Dict[str, Any]:
    """Read and validate the results file ``path``.

    Raises:
        FileNotFoundError: no such file.
        ResultsSchemaError: not JSON, another schema, or not a results document (names the
            bad field).
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as exc:
            raise ResultsSchemaError(f"{path}: not JSON: {exc}") from None
    return from_json(data, path)


# -- views for readers -------------------------------------------------------------------------


def nested_view(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The per-model tables of a document, in run.py's layout, for the docs generators
    and ``compare.py``: ``{"env", "settings", "notes", "host_probe_us", "models": {MODEL:
    {"decode": {BS: {METHOD: cell}}, "ratios": {BS: {METHOD: {REF: {median, lo, hi}}}},
    "prefill" (the first request count's rows), "prefill_by_requests": {R: {TOKENS: {METHOD:
    cell}}} (the other request counts', where there are several), "prefill_ratios",
    "capture": {NAME: {sizes, capture_s, pool_mb, ...}},
    "replay_prepare_us": {NAME: us}, "max_abs_diff_vs_eager": {NAME: {BS: diff}}, ...}}}``
    (size keys are strings, as JSON keys were; prefill runners are ``"NAME (prefill)"``)."""
    extra = doc.get("extra") or {}
    models: Dict[str, Dict[str, Any]] = {}

    def model(name: str) -> Dict[str, Any]:
        return models.setdefault(
            name, {"decode": {}, "ratios": {}, "prefill": {}, "capture": {}, "replay_prepare_us": {}}
        )

    first_requests: Dict[str, Any] = {}
    for t in doc.get("timings", []):
        x = str(t.get(_size_field(t["phase"])))
        cell = {k: v for k, v in t.items() if k not in ("model", "phase", "method", "batch_size", "num_tokens")}
        diff = cell.pop("max_abs_diff", None)
        rows = model(t["model"])[t["phase"]]
        if t["phase"] == "prefill" and t.get("requests") is not None:
            # The first request count of a model's prefill rows is its prefill table.
            first = first_requests.setdefault(t["model"], t["requests"])
            if t["requests"] != first and cell.get("requests") is not None:
                by = model(t["model"]).setdefault("prefill_by_requests", {})
                rows = by.setdefault(str(t["requests"]), {})
        rows.setdefault(x, {})[t["method"]] = cell
        if diff is not None and t["phase"] == "decode":
            model(t["model"]).setdefault("max_abs_diff_vs_eager", {}).setdefault(t["method"], {})[x] = diff
    for r in doc.get("ratios", []):
        key = "ratios" if r["phase"] == "decode" else "prefill_ratios"
        x = str(r.get(_size_field(r["phase"])))
        stats = {k: r[k] for k in ("median", "lo", "hi")}
        model(r["model"]).setdefault(key, {}).setdefault(x, {}).setdefault(r["method"], {})[r["reference"]] = stats
    back = {v: k for k, v in _CAPTURE_RENAMES.items()}
    for r in doc.get("runners", []):
        name = r["backend"] + (" (prefill)" if r["phase"] == "prefill" else "")
        m = model(r["model"])
        m["capture"][name] = {
            back.get(k, k): v for k, v in r.items() if k not in ("model", "phase", "backend", "replay_prepare_us")
        }
        if r.get("replay_prepare_us") is not None:
            m["replay_prepare_us"][name] = r["replay_prepare_us"]
    for name, rest in (extra.get("models") or {}).items():
        model(name).update(rest)
    env = dict(doc.get("env") or {})
    env.setdefault("gpu", env.get("device_name"))
    return {
        "schema": doc.get("schema"),
        "tool": doc.get("tool"),
        "env": env,
        "settings": doc.get("settings") or {},
        "notes": doc.get("notes") or [],
        "host_probe_us": extra.get("host_probe_us") or {},
        "models": models,
    }
