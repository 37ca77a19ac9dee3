"""Execute a notebook from notebooks/ on a report, as CI does for every notebook."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def run_notebook(path: Path, report_json: Path, monkeypatch) -> list:
    """Run ``path`` with ``SPECDEC_BENCH_JSON=report_json``; returns every code cell's
    outputs. Fails if the notebook was committed with outputs or a cell raised."""
    import nbclient  # dev extras: CI runs every notebook
    import nbformat

    book = nbformat.read(path, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit it clean"
    monkeypatch.setenv("SPECDEC_BENCH_JSON", str(report_json))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3").execute()
    outputs = [o for c in code for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors[0].get("evalue")
    return outputs


def figures(outputs: list) -> list:
    return [o for o in outputs if "image/png" in o.get("data", {})]
