"""Regenerate the reports of the traces the project ships (``reports/report/`` in the repository).

Run from the repository root::

    python -m gpumem.report.bundled

It writes ``reports/report/<trace file>/`` for every trace in ``data/traces/`` (every policy, on a simulated
H200, 400 samples per policy to keep the files small; the fit matrix over a spread of profiles from 2 GB to
141 GB) and ``reports/report/index.html`` linking them, each
folder replaced only once its new report is complete. ``--traces DIR``, ``--out DIR`` and ``--device SPEC``
change where it reads and writes and what it replays on.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import sys
from pathlib import Path

from .build import DEFAULT_DEVICES, FIT_DEVICES, ReportOptions, build_report

log = logging.getLogger(__name__)

TRACE_SUFFIXES = (".pickle.gz", ".pickle", ".csv.gz", ".csv", ".gmt.gz", ".gmt")
SAMPLES = 400


def report_name(path: Path) -> str:
    """The folder name of a trace's report: its file name without the compression suffix."""
    name = path.name
    return name[:-3] if name.endswith(".gz") else name


def traces_in(folder: Path) -> list[Path]:
    """The trace files of ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    """Write the bundled reports; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m gpumem.report.bundled", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="data/traces", help="folder of traces (default: %(default)s)")
    parser.add_argument("--out", default="reports/report", help="folder of the reports (default: %(default)s)")
    parser.add_argument("--device", action="append", help=f"device spec, repeatable (default: {DEFAULT_DEVICES[0]})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    traces = traces_in(Path(args.traces))
    if not traces:
        print(f"no traces in {args.traces}", file=sys.stderr)
        return 2
    out = Path(args.out)
    devices = tuple(args.device or DEFAULT_DEVICES)
    rows = []
    for t in traces:
        name = report_name(t)
        command = (f"gpumem report {args.traces}/{t.name} " + " ".join(f"--device {d}" for d in devices)
                   + f" --policy all --samples {SAMPLES} --out {args.out}/{name}")
        result = build_report(t, out / name, ReportOptions(devices=devices, samples=SAMPLES, fit_devices=FIT_DEVICES), force=True,
                              command=command)
        rows.append((name, result.summary))
        print(f"{name}: {out / name / 'index.html'}", flush=True)
    _write_index(out, rows)
    return 0


def _write_index(out: Path, rows: list[tuple[str, list[dict]]]) -> None:
    e = html.escape
    policies = list(dict.fromkeys(r["policy"] for _, summary in rows for r in summary))
    lines = ["<!doctype html><html lang=en><head><meta charset=utf-8><title>gpumem reports</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1000px;margin:24px auto;padding:0 16px}"
             "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
             "td.l,th.l{text-align:left}th{background:#f4f4f4}</style></head><body>",
             "<h1>gpumem reports of the bundled traces</h1>",
             "<p>Each trace in <code>data/traces/</code> replayed under every allocator policy on a simulated "
             "H200 (each fit matrix spans simulated profiles from 2 GB to 141 GB). The table gives the overhead (peak reserved / peak live &minus; 1); each trace's report has "
             "the figures. Regenerate with <code>python -m gpumem.report.bundled</code>.</p>",
             "<table><tr><th class=l>trace</th><th>peak live (GiB)</th>"
             + "".join(f"<th>{e(p)}</th>" for p in policies) + "</tr>"]
    for name, summary in rows:
        by = {r["policy"]: r for r in summary}
        live = next((r["peak_live_bytes"] for r in summary if r.get("peak_live_bytes")), 0)
        cells = "".join(f"<td>{by[p]['overhead']:.1%}</td>" if p in by and by[p].get("overhead") is not None
                        else "<td>-</td>" for p in policies)
        lines.append(f"<tr><td class=l><a href='{e(name)}/index.html'>{e(name)}</a></td>"
                     f"<td>{live / (1 << 30):.2f}</td>{cells}</tr>")
    lines.append("</table></body></html>\n")
    (out / "index.html").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({name: summary for name, summary in rows}, indent=1,
                                                 sort_keys=True) + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
