"""Token records at scale: append-only compressed shards, each sealed once, with a manifest.

Tens of thousands of records made over many CPU-hours on machines that come and go must live in
the repository, and a file that grows and is committed again re-bloats git with every version. So
records go into shards of a fixed size per domain:

* the shard being filled is plain JSONL under the work folder (``$DFLASH_HOME/shards/<pair>/open/
  <domain>-<NNNN>.jsonl``, outside the work tree); each record is one line, written then flushed
  and synced. A run killed mid-line (or stopped by a full disk) leaves a line cut short that every
  reader skips, and its prompt is generated again: no record is lost, repeated or corrupt;
* when it holds its size it is *sealed*: gzip-compressed reproducibly (no timestamp in the header,
  so the same records give the same bytes) into ``sealed/<domain>-<NNNN>.jsonl.gz`` through a
  temporary file and a rename, entered in ``manifest.json`` (rewritten the same way), and only
  then is the open file removed. A sealed shard is never written again;
* :func:`publish` copies sealed shards into the repository folder (``datasets/<pair>/shards/``)
  with the same manifest entries, to be committed once each. A name that is already there with
  other bytes is refused.

The manifest records the target's fingerprint: records of another target are refused, so two
targets never mix. The set of prompt ids and of prompt token hashes already in any shard (work or
repository, sealed or open) is what a restarted run skips: resumable and deduplicated.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataSetError
from ..files import write_atomic
from .jsonl import open_append

MANIFEST = "manifest.json"
FORMAT = "dflash-shards/1"
NAME = re.compile(r"^(?P<domain>[a-z0-9_]+)-(?P<num>\d{4,})$")


def prompt_key(prompt_ids: list[int]) -> str:
    """A short hash of a prompt's token ids: the same prompt under two ids is one record."""
    return hashlib.sha1(json.dumps(list(prompt_ids)).encode()).hexdigest()[:20]


def compress(records: list[dict]) -> bytes:
    """Records as gzip-compressed JSONL, byte-for-byte reproducible (header time 0)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        for rec in records:
            gz.write((json.dumps(rec, separators=(",", ":")) + "\n").encode())
    return buf.getvalue()


def read_jsonl_lines(path: Path) -> Iterator[dict]:
    """The complete records of an open shard; a line cut short by an interrupted run is skipped."""
    with Path(path).open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                continue  # the last line of a killed run: its prompt is generated again
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "id" in rec and "response_ids" in rec:
                yield rec


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return {"format": FORMAT, "target_fingerprint": None, "shards": {}}
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise DataSetError(f"{path}: not valid JSON") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("shards"), dict):
        raise DataSetError(f"{path}: not a {FORMAT} manifest")
    return manifest


def write_manifest(folder: Path, manifest: dict) -> None:
    write_atomic(Path(folder) / MANIFEST,
                  (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def read_sealed(folder: Path, name: str, entry: dict) -> list[dict]:
    """A sealed shard's records, after checking its sha256 and count against the manifest."""
    path = Path(folder) / f"{name}.jsonl.gz"
    if not path.is_file():
        raise DataSetError(f"{path}: listed in {folder / MANIFEST} but missing")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        raise DataSetError(f"{path}: sha256 {digest[:12]}... does not match the manifest's "
                           f"{str(entry.get('sha256'))[:12]}...: the shard was changed or cut")
    records = [json.loads(line) for line in gzip.decompress(data).splitlines() if line.strip()]
    if len(records) != entry.get("count"):
        raise DataSetError(f"{path}: {len(records)} records, the manifest says {entry.get('count')}")
    return records


def check_fingerprint(folder: Path, manifest: dict, fingerprint: str) -> None:
    have = manifest.get("target_fingerprint")
    if have is not None and have != fingerprint:
        raise DataSetError(f"{Path(folder) / MANIFEST}: holds records of target_fingerprint "
                           f"{have!r}, this target is {fingerprint!r}; records of different "
                           "targets must not mix: use another shard folder")


class ShardStore:
    """The open and sealed shards of one target: what is done, and where the next record goes.

    ``work``: the folder written to (``open/``, ``sealed/``, ``manifest.json``); ``repo``: the
    repository's shard folder (read for what is done and for numbering; written only by
    :func:`publish`). ``sizes`` maps a domain to its records per shard (``"*"``: the default).
    """

    def __init__(self, work: str | Path, fingerprint: str, repo: str | Path | None = None,
                 sizes: dict[str, int] | None = None):
        self.work = Path(work)
        self.repo = Path(repo) if repo is not None else None
        self.fingerprint = fingerprint
        self.sizes = {"*": 500, **(sizes or {})}
        (self.work / "open").mkdir(parents=True, exist_ok=True)
        (self.work / "sealed").mkdir(parents=True, exist_ok=True)
        self.manifest = read_manifest(self.work)
        check_fingerprint(self.work, self.manifest, fingerprint)
        self.repo_manifest = read_manifest(self.repo) if self.repo is not None else None
        if self.repo_manifest is not None:
            check_fingerprint(self.repo, self.repo_manifest, fingerprint)
        if self.manifest["target_fingerprint"] is None:
            self.manifest["target_fingerprint"] = fingerprint
            write_manifest(self.work, self.manifest)
        self.done_ids: set[str] = set()
        self.done_keys: set[str] = set()
        self.counts: dict[str, int] = {}  # records per domain, sealed and open
        self._recover()
        self._load()
        self.open_counts: dict[str, int] = {}
        self._files: dict[str, io.TextIOBase] = {}

    # -- reading what is there ------------------------------------------------------------------

    def _recover(self) -> None:
        """Finish a seal that was interrupted: an open shard already in the manifest is removed,
        a sealed file that the manifest lacks is a leftover (its open shard is still there)."""
        for path in (self.work / "open").glob("*.jsonl"):
            if path.stem in self.manifest["shards"]:
                path.unlink()
        for path in (self.work / "sealed").glob("*.jsonl.gz"):
            if path.name[: -len(".jsonl.gz")] not in self.manifest["shards"]:
                path.unlink()
        for path in list((self.work / "sealed").glob("*.tmp*")) + \
                list((self.work / "open").glob("*.tmp*")):
            path.unlink()

    def _note(self, rec: dict) -> None:
        self.done_ids.add(str(rec["id"]))
        self.done_keys.add(prompt_key(rec["prompt_ids"]))
        domain = rec.get("domain", "?")
        self.counts[domain] = self.counts.get(domain, 0) + 1

    def _load(self) -> None:
        seen: set[str] = set()
        for folder, manifest in ((self.work / "sealed", self.manifest),
                                 (self.repo, self.repo_manifest)):
            if manifest is None:
                continue
            for name, entry in sorted(manifest["shards"].items()):
                if name in seen:
                    continue
                seen.add(name)
                for rec in read_sealed(folder, name, entry):
                    self._note(rec)
        for path in sorted((self.work / "open").glob("*.jsonl")):
            for rec in read_jsonl_lines(path):
                self._note(rec)

    def sealed_names(self) -> set[str]:
        names = set(self.manifest["shards"])
        if self.repo_manifest is not None:
            names |= set(self.repo_manifest["shards"])
        return names

    def _open_path(self, domain: str) -> Path:
        """The open shard of ``domain``: the existing one, else the next number after every
        sealed shard of the domain (here or in the repository)."""
        existing = sorted((self.work / "open").glob(f"{domain}-*.jsonl"))
        if existing:
            return existing[-1]
        nums = [int(m["num"]) for n in self.sealed_names()
                if (m := NAME.match(n)) and m["domain"] == domain]
        return self.work / "open" / f"{domain}-{max(nums, default=0) + 1:04d}.jsonl"

    def is_done(self, item_id: str, prompt_ids: list[int] | None = None) -> bool:
        return item_id in self.done_ids or (
            prompt_ids is not None and prompt_key(prompt_ids) in self.done_keys)

    # -- writing --------------------------------------------------------------------------------

    def size(self, domain: str) -> int:
        return int(self.sizes.get(domain, self.sizes["*"]))

    def append(self, rec: dict) -> Path | None:
        """Write one record to its domain's open shard; returns a newly sealed shard's path when
        this record filled it. A record already done (by id or by prompt tokens) is skipped."""
        domain = rec.get("domain")
        if not domain or not re.fullmatch(r"[a-z0-9_]+", domain):
            raise DataSetError(f"record {rec.get('id')!r}: `domain` {domain!r} must be lowercase "
                               "letters, digits or _")
        if self.is_done(str(rec["id"]), rec["prompt_ids"]):
            return None
        f = self._files.get(domain)
        if f is None:

            path = self._open_path(domain)
            self.open_counts[domain] = sum(1 for _ in read_jsonl_lines(path)) if path.exists() else 0
            f = self._files[domain] = open_append(path)
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
        self._note(rec)
        self.open_counts[domain] += 1
        if self.open_counts[domain] >= self.size(domain):
            return self.seal(domain)
        return None

    def seal(self, domain: str) -> Path | None:
        """Compress the domain's open shard into ``sealed/`` and enter it in the manifest."""
        f = self._files.pop(domain, None)
        if f is not None:
            f.close()
        path = self._open_path(domain)
        if not path.exists():
            return None
        records = list(read_jsonl_lines(path))
        if not records:
            return None
        data = compress(records)
        out = self.work / "sealed" / f"{path.stem}.jsonl.gz"
        write_atomic(out, data)
        self.manifest["shards"][path.stem] = {
            "sha256": hashlib.sha256(data).hexdigest(), "count": len(records), "domain": domain,
            "bytes": len(data), "tokens": sum(len(r["prompt_ids"]) + len(r["response_ids"])
                                              for r in records)}
        write_manifest(self.work, self.manifest)
        path.unlink()
        self.open_counts.pop(domain, None)
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def status(self) -> dict:
        open_counts = {p.stem: sum(1 for _ in read_jsonl_lines(p))
                       for p in sorted((self.work / "open").glob("*.jsonl"))}
        return {"target_fingerprint": self.fingerprint, "records": dict(sorted(self.counts.items())),
                "total": sum(self.counts.values()), "sealed": len(self.sealed_names()),
                "open": open_counts}


def publish(work: str | Path, repo: str | Path) -> list[Path]:
    """Copy the work folder's sealed shards that the repository lacks into it, manifest entries
    too; returns the new files (commit each once). A shard name the repository already holds with
    other bytes is refused: sealed shards are never rewritten."""
    work, repo = Path(work), Path(repo)
    manifest = read_manifest(work)
    repo.mkdir(parents=True, exist_ok=True)
    repo_manifest = read_manifest(repo)
    if manifest["target_fingerprint"] is not None:
        check_fingerprint(repo, repo_manifest, manifest["target_fingerprint"])
        repo_manifest["target_fingerprint"] = manifest["target_fingerprint"]
    new = []
    for name, entry in sorted(manifest["shards"].items()):
        have = repo_manifest["shards"].get(name)
        if have is not None:
            if have["sha256"] != entry["sha256"]:
                raise DataSetError(f"{repo / name}.jsonl.gz: already in the repository with other "
                                   "bytes; sealed shards are never rewritten")
            continue
        read_sealed(work / "sealed", name, entry)  # checks the bytes before they travel
        data = (work / "sealed" / f"{name}.jsonl.gz").read_bytes()
        write_atomic(repo / f"{name}.jsonl.gz", data)
        repo_manifest["shards"][name] = dict(entry)
        new.append(repo / f"{name}.jsonl.gz")
    if new or not (repo / MANIFEST).is_file():
        write_manifest(repo, repo_manifest)
    return new


def iter_records(folder: str | Path) -> Iterator[dict]:
    """Every record of a shard folder (sealed shards checked against the manifest, then the open
    ones of a work folder)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    sealed_dir = folder / "sealed" if (folder / "sealed").is_dir() else folder
    for name, entry in sorted(manifest["shards"].items()):
        yield from read_sealed(sealed_dir, name, entry)
    if (folder / "open").is_dir():
        for path in sorted((folder / "open").glob("*.jsonl")):
            yield from read_jsonl_lines(path)


__all__ = ["ShardStore", "publish", "iter_records", "prompt_key", "compress", "read_manifest"]
