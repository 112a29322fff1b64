"""Keep the precious part of the training data in the repository: the token records.

Generated responses cost CPU-hours; as token ids they are a few MB. This writes
``datasets/<name>/<domain>.jsonl.gz`` from a data root's ``gen-*/gen-*.jsonl`` records (ids, domain,
prompt and response token ids, finish reason, conversation), and ``--restore`` puts them back
under a data root on a new machine, where ``dflash datagen`` skips them and training recomputes
their features (``dflash train --features-only``).

    python recipes/smollm2/snapshot_training_data.py DATA_ROOT [--name smollm2]   # save
    python recipes/smollm2/snapshot_training_data.py DATA_ROOT --restore [--limit N]  # put back

``--limit N`` restores only the first N records of each domain (the recipe's smoke mode).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

KEEP = ("id", "domain", "prompt_ids", "response_ids", "finish_reason", "messages")
REPO = Path(__file__).resolve().parents[2]


def records(root: Path) -> dict[str, list[dict]]:
    by_domain: dict[str, dict[str, dict]] = {}
    for path in sorted(root.glob("gen-*/gen-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run
            domain = rec.get("domain") or path.parent.name.removeprefix("gen-")
            by_domain.setdefault(domain, {})[rec["id"]] = {k: rec[k] for k in KEEP if k in rec}
    return {d: [recs[k] for k in sorted(recs)] for d, recs in by_domain.items()}


def is_records(gz: Path) -> bool:
    """A snapshot of generated records (not a prompt file kept in the same folder)."""
    with gzip.open(gz, "rt") as f:
        first = f.readline()
    try:
        return "response_ids" in json.loads(first)
    except json.JSONDecodeError:
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--store", type=Path, default=None,
                    help="where the snapshot lives (default datasets/NAME in the repository)")
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--limit", type=int, default=None,
                    help="with --restore: only the first N records of each domain")
    args = ap.parse_args(argv)
    store = args.store or REPO / "datasets" / args.name
    if args.restore:
        for gz in sorted(store.glob("*.jsonl.gz")):
            domain = gz.name.removesuffix(".jsonl.gz")
            if not is_records(gz):
                continue  # e.g. the magpie prompt files kept beside the records
            out = args.root / f"gen-{domain}" / "gen-restored.jsonl"
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".tmp")
            text = gzip.decompress(gz.read_bytes())
            if args.limit is not None:
                text = b"".join(text.splitlines(keepends=True)[: args.limit])
            tmp.write_bytes(text)
            tmp.replace(out)
            print(f"{gz} -> {out}")
        return
    store.mkdir(parents=True, exist_ok=True)
    for domain, recs in records(args.root).items():
        path = store / f"{domain}.jsonl.gz"
        tmp = path.with_suffix(".tmp")
        text = "".join(json.dumps(rec, separators=(",", ":")) + "\n" for rec in recs)
        # mtime 0: the same records give the same bytes (no churn in the repository)
        tmp.write_bytes(gzip.compress(text.encode(), mtime=0))
        tmp.replace(path)
        print(f"{len(recs)} {domain} records -> {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
