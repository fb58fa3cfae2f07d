"""`fxquant capture ls|verify|export-pt DIR`: inspect, check and export capture sets."""
from __future__ import annotations

import argparse
import collections
import json
import sys

from tabulate import tabulate

from fxquant.cli.options import WHERE_HELP, nothing_found, where_conditions


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="inspect (ls), check (verify) or export (export-pt) a capture directory")
    verbs = p.add_subparsers(dest="capture_verb", metavar="ACTION")
    verbs.required = True
    ls = verbs.add_parser("ls", help="summarise a capture set: runs, ranks, counts per role and module")
    ls.add_argument("dir", help="a capture directory (the root holding rank-NNNNN/ directories)")
    ls.add_argument("--records", action="store_true", help="one line per record (default: counts only)")
    ls.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help=f"keep {WHERE_HELP}")
    ls.add_argument("--json", action="store_true", help="print the selected records as JSON lines instead of tables")
    ls.set_defaults(func=run_ls)
    v = verbs.add_parser("verify", help="check every tensor's checksum, dtype and shape and every manifest line's crc; "
                         "report partial, missing or unreferenced shards, lost or repeated records, and sessions "
                         "that ended on an error (docs/capture.md)")
    v.add_argument("dir", help="a capture directory")
    v.set_defaults(func=run_verify)
    e = verbs.add_parser("export-pt", help="write the predecessor's .pt files (torch.load(weights_only=True))")
    e.add_argument("dir", help="a capture directory")
    e.add_argument("out", help="output directory (files go to OUT/{quant_type}/)")
    e.add_argument("--quant-type", default=None, help="quant type in names and directory (default: the run's scheme)")
    e.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help=f"export only {WHERE_HELP}")
    e.add_argument("--replace", action="store_true",
                   help="delete the .pt files an earlier export left in OUT/{quant_type}/ first (default: refuse "
                        "such a directory: the records would be there twice)")
    e.set_defaults(func=run_export)


def _filtered(args):
    from fxquant import capture

    cs = capture.open(args.dir)
    cond = where_conditions(args.where)
    out = cs.query(**cond) if cond else cs
    len(out)  # a .pt directory is indexed on first use: its refused files are known after this
    for p in out.problems:  # torn lines skipped; .pt files refused
        print(f"warning: {p}", file=sys.stderr)
    return out


def _nothing(args, cs, what: str = "capture records", found: int | None = None) -> int:
    """0, or 1 after saying that the selection is empty (``options.nothing_found``)."""
    error = nothing_found(len(cs) if found is None else found, cs.problems, [args.dir], args.where, what)
    if error is None:
        return 0
    print(f"fxquant capture {args.capture_verb}: error: {error}", file=sys.stderr)
    return 1


def run_ls(args: argparse.Namespace) -> int:
    cs = _filtered(args)
    if args.json:
        from fxquant.capture.layout import strict_json

        for r in cs:
            print(json.dumps(strict_json(r.fields), sort_keys=True, allow_nan=False))
        return _nothing(args, cs)
    for name, m in cs.meta.items():
        c = m["committed"]
        state = "committed" if c else "NOT committed (crashed or running)"
        extra = f", stop reason: {c['stop_reason']}" if c and c.get("stop_reason") else ""
        print(f"{name}: run {m['run'].get('run_id')} scheme {m['run'].get('scheme')}: {state}{extra}")
    if args.records:
        rows = [[r.seq, r.rank, r.iteration, r.micro_batch, r.module, r.layer, r.role, r.copy, r.direction,
                 r.phase, "x".join(map(str, r.shape)), r.dtype, r.key or "stats"] for r in cs]
        print(tabulate(rows, headers=["seq", "rank", "it", "mb", "module", "layer", "role", "copy", "dir", "phase",
                                      "shape", "dtype", "key"]))
    counts = collections.Counter((r.component, r.role, r.copy, r.direction) for r in cs)
    print(tabulate([[*k, n] for k, n in sorted(counts.items())], headers=["component", "role", "copy", "dir", "records"]))
    nbytes = sum(r.fields.get("stored_shape") is not None and 1 for r in cs)
    print(f"{len(cs)} records ({nbytes} with tensors), iterations {cs.values('iteration')}, "
          f"ranks {cs.values('rank')}, modules {len(cs.values('module'))}")
    return _nothing(args, cs)


def run_verify(args: argparse.Namespace) -> int:
    from fxquant import capture

    cs = capture.open(args.dir, skip_bad_ranks=True)  # an unreadable rank is one problem; the others are checked
    problems = cs.verify()
    for p in problems:
        print(p, file=sys.stderr)
    n = sum(1 for r in cs if r.has_tensor)
    print(f"{args.dir}: {len(cs)} records, {n} tensors checked, {len(problems)} problem(s)")
    return 1 if problems else 0


def run_export(args: argparse.Namespace) -> int:
    from fxquant.capture.export import export_pt, statistics_only

    cs = _filtered(args)
    skipped = statistics_only(cs)
    if skipped:
        print(f"{skipped} statistics-only record(s) skipped: they hold no tensor (what: stats), and a .pt file holds "
              "one; their statistics are in the manifest (fxquant capture ls --json)", file=sys.stderr)
    if _nothing(args, cs, "records with a stored tensor", len(cs) - skipped):
        return 1
    paths = export_pt(cs, args.out, args.quant_type, skipped=skipped, replace=args.replace)
    print(f"wrote {len(paths)} .pt files under {args.out}")
    return 0
