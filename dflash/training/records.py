"""``dflash records``: the long-running job that writes token records at scale into sealed shards.

Making records is the long pole of training a drafter on a CPU (CPU-hours per thousand), so it
runs in the background for days, across machines, beside other work:

* ``dflash records heldout`` writes the held-out splits of the new domains (agent turns, long
  contexts) once, before any generation (:func:`dflash.training.sources.heldout_sets`);
* ``dflash records run`` builds every prompt source (:mod:`dflash.training.sources`), mixes the
  domains by weight, skips what any shard already holds (by id and by prompt tokens, and the
  records kept before shards existed), and lets the target write each response itself (greedy,
  its chat template, one continuous batch per length bucket, through
  :class:`~dflash.training.capture.RolloutEngine` as ``dflash datagen`` does) into
  :class:`~dflash.training.shards.ShardStore`. Killed at any moment it resumes without losing or
  repeating a record; restarted with more sources it simply has more to do;
* between chunks of prompts (``--chunk``, 512 by default: up to ~40 minutes of one core) it
  sleeps while ``$DFLASH_HOME/PAUSE`` exists (speed is measured on a quiet machine) and stops
  cleanly once ``$DFLASH_HOME/STOP`` exists; SIGTERM stops it at once, each record it made already
  in an open shard (``seal`` then closes them); its pid is in
  ``$DFLASH_HOME/datagen.pid`` and its progress in ``<work>/status.json`` (this run's and, as
  ``made_all_runs`` / ``cpu_s_all_runs``, every run's: the CPU-hours a data budget counts);
* ``dflash records publish`` copies sealed shards into the repository (commit each once);
  ``dflash records status`` prints what is done.

Only token ids are stored: features are recomputed from them for training (see
``docs/drafter-data.md`` for what that costs).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..console import log
from ..default_pair import cache_dir, default_target_path
from ..errors import DataSetError, DFlashError
from ..files import write_atomic, write_json_atomic
from ..prompts import encode_prompt
from .shards import ShardStore, iter_records, prompt_key, publish
from .sources import WEIGHTS, build_sources, heldout_sets, interleave, stdlib_files

if TYPE_CHECKING:  # capture loads MLX: run_records imports it when it runs
    from .capture import Rollout

REPO = Path(__file__).resolve().parents[2]
PAIR = "smollm2"
LEGACY = ("math", "chat", "code")  # records kept before shards: datasets/<pair>/<domain>.jsonl.gz
SHARD_SIZES = {"*": 500, "agent": 250, "long": 100}
BUCKETS = ((1536, 64), (4096, 12), (8192, 3))  # (most prompt + answer tokens, batch size)
CONTEXT = 8192  # positions the built-in target reads


def default_work() -> Path:
    return cache_dir() / "shards" / PAIR


def default_repo() -> Path:
    return REPO / "datasets" / PAIR / "shards"


def heldout_paths(repo_root: Path = REPO) -> list[Path]:
    """Every held-out prompt file: none of their text may reach training."""
    paths = sorted((repo_root / "dflash" / "assets" / "prompts").glob("*.jsonl"))
    paths += [p for p in (repo_root / "docs" / "bench").glob("*.jsonl")
              if "heldout" in p.name]
    paths += sorted((repo_root / "datasets" / PAIR).glob("*heldout*.jsonl*"))
    return paths


def split_paths(repo_root: Path = REPO) -> list[Path]:
    """The held-out splits of the new domains (built from held-out files and ids)."""
    return sorted((repo_root / "datasets" / PAIR / "heldout").glob("*.jsonl"))


def gsm8k_path() -> Path | None:
    env = os.environ.get("DFLASH_GSM8K")
    for p in ([Path(env)] if env else []) + [REPO.parent / "shared" / "datasets" /
                                              "gsm8k-train.jsonl"]:
        if p.is_file():
            return p
    return None


def legacy_records(repo_root: Path = REPO) -> list[dict]:
    out = []
    for domain in LEGACY:
        path = repo_root / "datasets" / PAIR / f"{domain}.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


def _wait_while_paused(pause: Path, between: Callable[[], None] | None = None) -> None:
    """Sleep while ``pause`` exists, running ``between`` (e.g. a seal request) as it waits."""
    if between is not None:
        between()
    if not pause.exists():
        return
    log(f"records: paused ({pause} exists)")
    while pause.exists():
        time.sleep(2.0)
        if between is not None:
            between()
    log("records: resumed")


def _seal_request(store: ShardStore, request: Path) -> Callable[[], None]:
    """``$DFLASH_HOME/SEAL``: seal every open shard now, full or not (before a machine goes away:
    a sealed shard can be published and committed), then remove the request."""
    def check() -> None:
        if not request.exists():
            return
        for path in sorted((store.work / "open").glob("*.jsonl")):
            sealed = store.seal(path.stem.rsplit("-", 1)[0])
            if sealed is not None:
                log(f"records: sealed {sealed.name} on request")
        request.unlink(missing_ok=True)
    return check


def _bucket(n: int) -> int:
    return next(i for i, (most, _) in enumerate(BUCKETS) if n <= most or i == len(BUCKETS) - 1)


def _earlier_runs(work: Path) -> dict[str, float]:
    """Records made and CPU-s spent by the earlier runs into ``work``, from its ``status.json``
    (a file from before these totals counts its own run only; an unreadable one counts nothing).
    What a killed run did after its last status write is not counted."""
    try:
        last = json.loads((work / "status.json").read_text())
    except (OSError, ValueError):
        return {"made": 0, "cpu_s": 0.0}
    return {"made": int(last.get("made_all_runs", last.get("made")) or 0),
            "cpu_s": float(last.get("cpu_s_all_runs", last.get("cpu_s")) or 0.0)}


class _Progress:
    """This run's counts and speed, written to ``<work>/status.json`` with every earlier run's
    totals (``made_all_runs``, ``cpu_s_all_runs``: the CPU-hours a data budget counts)."""

    def __init__(self, store: ShardStore, work: Path):
        self.store, self.work = store, work
        self.made = 0
        self.stats: dict = {"started": time.time(), "made": 0, "by_domain": {}, "tokens": 0}
        self.before = _earlier_runs(work)
        self.cpu0, self.wall0 = time.process_time(), time.time()

    def reached(self, max_records: int | None) -> bool:
        return max_records is not None and self.made >= max_records

    def add(self, rec: dict) -> None:
        """Count one stored record; every 16th, write the status and log the speed."""
        self.made += 1
        by_domain = self.stats["by_domain"]
        by_domain[rec["domain"]] = by_domain.get(rec["domain"], 0) + 1
        self.stats["tokens"] += len(rec["prompt_ids"]) + len(rec["response_ids"])
        if self.made % 16 == 0:
            s = self.write()
            log(f"records: {self.made} made ({s['records_per_cpu_hour']}/CPU-h, "
                f"{s['records_per_wall_hour']}/h), {s['store']['total']} in shards")

    def write(self, done: bool = False) -> dict:
        made = self.made
        cpu = time.process_time() - self.cpu0
        wall = time.time() - self.wall0
        self.stats.update(made=made, cpu_s=round(cpu, 1), wall_s=round(wall, 1),
                          records_per_cpu_hour=round(made / cpu * 3600, 1) if cpu else None,
                          records_per_wall_hour=round(made / wall * 3600, 1) if wall else None,
                          finished=done, store=self.store.status(), pid=os.getpid(),
                          updated=time.time(), made_all_runs=self.before["made"] + made,
                          cpu_s_all_runs=round(self.before["cpu_s"] + cpu, 1))
        write_json_atomic(self.work / "status.json", self.stats)
        return self.stats


def _default_sources(tokenizer, work: Path, repo: Path | None, legacy: list[dict],
                     domains: list[str] | None,
                     prompt_files: list[tuple[str, Path]] | None) -> dict[str, list[dict]]:
    """The built-in prompt sources, by domain. Chat records already made (kept before shards, or
    in the work and repository shards) with fewer than 3 user turns are continued as
    conversations."""
    chat_done = [r for r in legacy if r.get("domain") == "chat"]
    for folder in [work] + ([repo] if repo is not None and repo.is_dir() else []):
        chat_done += [r for r in iter_records(folder)
                      if r.get("domain") == "chat" and r.get("messages")
                      and sum(m["role"] == "user" for m in r["messages"]) < 3]
    magpie_files = sorted((default_repo() / "prompts").glob("magpie-*.jsonl.gz"))
    magpie_files += sorted((REPO / "datasets" / PAIR).glob("chat-prompts.jsonl.gz"))
    return build_sources(tokenizer, gsm8k=gsm8k_path(), chat_records=chat_done,
                         magpie_files=magpie_files, heldout_files=heldout_paths(),
                         split_files=split_paths(), prompt_files=prompt_files or (),
                         domains=domains, files=stdlib_files(), log=log)


def _chunk_buckets(chunk: list[dict], tokenizer, store: ShardStore, made_keys: set[str]
                   ) -> tuple[dict[str, dict], dict[int, list[tuple]]]:
    """The prompts of ``chunk`` still to answer, by id, and their ``(id, prompt ids, budget)``
    by length bucket; ``made_keys`` (the prompt keys already made) grows with them."""
    buckets: dict[int, list[tuple]] = {}
    items = {}
    for it in chunk:
        ids = encode_prompt(tokenizer, it)
        key = prompt_key(ids)
        if store.is_done(it["id"], ids) or key in made_keys:
            continue
        want = int(it.get("max_tokens") or 384)
        room = CONTEXT - len(ids)
        if room < min(16, want):
            continue  # no room to answer within the target's context
        budget = min(want, room)
        made_keys.add(key)  # the same prompt twice in this chunk is made once
        items[it["id"]] = it
        buckets.setdefault(_bucket(len(ids) + budget), []).append((it["id"], ids, budget))
    return items, buckets


def _record(result: Rollout, item: dict) -> dict:
    """The stored record of one answered prompt."""
    rec = {"id": result.id, "domain": item["domain"], "source": item.get("source"),
           "prompt_ids": result.prompt_ids, "response_ids": result.response_ids,
           "finish_reason": result.finish_reason}
    if item["domain"] == "chat":  # a conversation can be continued
        rec["messages"] = item["messages"]
    return rec


def run_records(target: str | None = None, work: str | Path | None = None,
                repo: str | Path | None = None, *, domains: list[str] | None = None,
                weights: dict[str, float] | None = None, max_records: int | None = None,
                chunk: int = 512, home: str | Path | None = None, pid_file: bool = True,
                batch_scale: float = 1.0, sources: dict[str, list[dict]] | None = None,
                legacy: list[dict] | None = None, magpie: int = 0,
                prompt_files: list[tuple[str, Path]] | None = None) -> dict:
    """Generate records until every source is done (or ``max_records``); returns the counts.

    ``sources`` (by domain) replaces the built-in prompt sources (tests, other targets);
    ``legacy`` lists records kept elsewhere that count as done.
    """
    from ..target import load_target, target_parts
    from .capture import RolloutEngine
    from .dataset import target_fingerprint

    target = str(target or default_target_path())
    home = Path(home) if home is not None else cache_dir()
    work = Path(work) if work is not None else default_work()
    repo = Path(repo) if repo is not None else (default_repo() if sources is None else None)
    model, tokenizer = load_target(target)
    parts = target_parts(model)
    config_path = Path(target) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    store = ShardStore(work, target_fingerprint(parts, config), repo, SHARD_SIZES)
    home.mkdir(parents=True, exist_ok=True)
    pause, stop = home / "PAUSE", home / "STOP"
    seal = _seal_request(store, home / "SEAL")
    if pid_file:
        write_json_atomic(home / "datagen.pid.json", {"pid": os.getpid(), "started": time.time()})
        (home / "datagen.pid").write_text(f"{os.getpid()}\n")
    if magpie and sources is None:
        magpie_stage(target, magpie, home=home, repo=repo or default_repo(), pause=pause)
    legacy = legacy_records() if legacy is None else legacy
    legacy_ids = {str(r["id"]) for r in legacy}
    made_keys = {prompt_key(r["prompt_ids"]) for r in legacy}
    if sources is None:
        sources = _default_sources(tokenizer, work, repo, legacy, domains, prompt_files)
    elif domains:
        sources = {d: v for d, v in sources.items() if d in domains}
    weights = dict(weights or WEIGHTS)
    for domain in sources:
        weights.setdefault(domain, min(WEIGHTS.values()))  # a user's own domain
    queue = interleave(sources, weights)
    todo = [it for it in queue if not store.is_done(it["id"]) and it["id"] not in legacy_ids]
    log(f"records: {len(queue)} prompts, {len(queue) - len(todo)} done, {len(todo)} to go; "
        f"{store.status()['total']} records in shards -> {work}")
    progress = _Progress(store, work)
    stopped = False
    try:
        for start in range(0, len(todo), chunk):
            _wait_while_paused(pause, seal)
            if stop.exists() or progress.reached(max_records):
                stopped = True
                break
            items, buckets = _chunk_buckets(todo[start:start + chunk], tokenizer, store, made_keys)
            for b, batch in sorted(buckets.items()):
                size = max(1, int(BUCKETS[b][1] * batch_scale))
                engine = RolloutEngine(parts, taps=[], max_tokens=CONTEXT, batch_size=size,
                                       stop_ids=tokenizer.eos_token_ids, temperature=0.0,
                                       capture=False)
                for r in engine.run(batch):
                    rec = _record(r, items[r.id])
                    sealed = store.append(rec)
                    if sealed is not None:
                        log(f"records: sealed {sealed.name}")
                    progress.add(rec)
                    _wait_while_paused(pause, seal)
                    if progress.reached(max_records):
                        break
                if progress.reached(max_records):
                    break
        stats = progress.write(done=not stopped)
    finally:
        store.close()
    log(f"records: {progress.made} records made this run; {store.status()['total']} in shards")
    return stats


def magpie_stage(target: str, n: int, *, home: Path, repo: Path, pause: Path,
                 seed: int = 30, step: int = 64) -> Path | None:
    """Top the target's own user turns up to ``n`` (``dflash magpie``, steered by language,
    length and area), pausable between steps, then keep them once: the training turns as
    ``<repo>/prompts/magpie-0001.jsonl.gz``, the held-out 5 % as
    ``datasets/<pair>/heldout/chat-magpie-0001.jsonl``. Skipped when the file exists."""
    from .magpie import write_user_turns
    from .sources import magpie_steer, read_jsonl_any

    final = repo / "prompts" / "magpie-0001.jsonl.gz"
    if final.is_file():
        return final
    work = home / "shards" / PAIR / "prompts"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "magpie-0001.jsonl"
    held = out.with_name(out.stem + "-heldout" + out.suffix)

    def have() -> int:
        return sum(len(read_jsonl_any(p)) for p in (out, held) if p.is_file())

    while (left := n - have()) > 0:
        _wait_while_paused(pause)
        write_user_turns(target, out, min(step, left), seed=seed, steer=magpie_steer(),
                         prefix="magpie", batch_size=64)
    rows = read_jsonl_any(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(final, gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(),
                                      mtime=0))
    held_final = REPO / "datasets" / PAIR / "heldout" / "chat-magpie-0001.jsonl"
    write_atomic(held_final, held.read_text() if held.is_file() else "")
    log(f"records: {len(rows)} magpie turns -> {final}; held out -> {held_final}")
    return final


def _running_job(home: Path) -> int | None:
    try:
        pid = int((home / "datagen.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def seal_now(work: Path, home: Path | None = None, timeout: float = 600.0) -> Path:
    """Seal every open shard, full or not: a running job is asked to (``$DFLASH_HOME/SEAL``,
    seen between records) so that nothing writes to a shard as it is sealed; with no job
    running, the shards are sealed here."""
    from .shards import read_manifest

    home = Path(home) if home is not None else cache_dir()
    pid = _running_job(home)
    if pid is not None:
        request = home / "SEAL"
        request.touch()
        log(f"records: asked the running job (pid {pid}) to seal its open shards")
        deadline = time.time() + timeout
        while request.exists() and time.time() < deadline and _running_job(home) == pid:
            time.sleep(1.0)
        if request.exists():
            raise DFlashError(f"records: the job (pid {pid}) did not seal within {timeout:.0f} s; "
                              f"{request} is still there")
        return work
    fingerprint = read_manifest(work)["target_fingerprint"]
    if fingerprint is None:
        raise DataSetError(f"{work}: no shards to seal")
    store = ShardStore(work, fingerprint)
    (home / "SEAL").unlink(missing_ok=True)  # a request no job will see any more
    for path in sorted((work / "open").glob("*.jsonl")):
        sealed = store.seal(path.stem.rsplit("-", 1)[0])
        if sealed is not None:
            log(f"records: sealed {sealed.name}")
    return work


def write_heldout(out: str | Path | None = None, target: str | None = None) -> list[Path]:
    """Write the agent and long-context held-out splits (refusing to change existing ones)."""
    from transformers import AutoTokenizer

    out = Path(out) if out is not None else REPO / "datasets" / PAIR / "heldout"
    tokenizer = AutoTokenizer.from_pretrained(str(target or default_target_path()))
    sets = heldout_sets(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, items in sets.items():
        path = out / f"{name}.jsonl"
        text = "".join(json.dumps(it) + "\n" for it in items)
        if path.is_file() and path.read_text() != text:
            raise DataSetError(f"{path}: already written with other prompts; held-out splits are "
                               "fixed once (remove it only if nothing was measured on it)")
        write_atomic(path, text)
        written.append(path)
        log(f"records: {len(items)} held-out {name} prompts -> {path}")
    return written


# ---------------------------------------------------------------------------------------------
# Command line (wired into ``dflash records`` by dflash/cli.py)


def add_records_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("action", choices=("run", "status", "seal", "publish", "heldout"),
                   help="run: generate (resumable); status: counts; seal: seal the open shards "
                        "now, full or not (asks a running job to); publish: copy sealed shards "
                        "into the repository; heldout: write the agent/long held-out splits")
    p.add_argument("--target", help="mlx-lm target folder (default: the built-in SmolLM2 target)")
    p.add_argument("--work", default=None,
                   help="shard work folder (default $DFLASH_HOME/shards/smollm2)")
    p.add_argument("--repo", default=None,
                   help="the repository's shard folder (default datasets/smollm2/shards)")
    p.add_argument("--domains", default=None,
                   help="comma-separated subset of " + ",".join(WEIGHTS))
    p.add_argument("--weights", default=None,
                   help="domain weights, e.g. chat=0.4,code=0.3 (default " +
                        ",".join(f"{k}={v}" for k, v in WEIGHTS.items()) + ")")
    p.add_argument("--prompts", action="append", default=[], metavar="DOMAIN=FILE",
                   help="also a JSONL prompt file of your own, tagged DOMAIN (repeatable)")
    p.add_argument("--max-records", type=int, default=None, help="stop after N new records")
    p.add_argument("--magpie", type=int, default=0, metavar="N",
                   help="first write N chat user turns with the target (`dflash magpie`, steered "
                        "by language, length and area), kept once in the repository; skipped "
                        "when they are there")
    p.add_argument("--chunk", type=int, default=512,
                   help="prompts read per round (then split by length into batches)")
    p.add_argument("--no-pid-file", dest="pid_file", action="store_false")
    return p


def _parse_weights(text: str | None) -> dict[str, float] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise DFlashError(f"--weights {text!r}: expected name=number pairs") from None
    return out


def run_records_cli(args: argparse.Namespace):
    work = Path(args.work) if args.work else default_work()
    repo = Path(args.repo) if args.repo else default_repo()
    if args.action == "heldout":
        return write_heldout(target=args.target)
    if args.action == "seal":
        return seal_now(work)
    if args.action == "publish":
        new = publish(work, repo)
        for path in new:
            log(f"records: published {path}")
        log(f"records: {len(new)} new sealed shards in {repo}")
        return repo
    if args.action == "status":
        from .shards import read_manifest

        manifest = read_manifest(work)
        print(json.dumps({"work": str(work), "manifest": {
            "target_fingerprint": manifest["target_fingerprint"],
            "shards": len(manifest["shards"]),
            "records": sum(e["count"] for e in manifest["shards"].values())},
            "status": json.loads((work / "status.json").read_text())
            if (work / "status.json").is_file() else None}, indent=1))
        return work
    domains = [d.strip() for d in args.domains.split(",")] if args.domains else None
    files = []
    for spec in args.prompts:
        domain, sep, path = spec.partition("=")
        if not sep or not path:
            raise DFlashError(f"--prompts {spec!r}: expected DOMAIN=FILE")
        files.append((domain, Path(path)))
    if domains is not None:
        domains += [d for d, _ in files if d not in domains]
    return run_records(args.target, work, repo, domains=domains,
                       weights=_parse_weights(args.weights), max_records=args.max_records,
                       chunk=args.chunk, pid_file=args.pid_file, prompt_files=files,
                       magpie=args.magpie)


__all__ = ["run_records", "write_heldout", "add_records_args", "run_records_cli"]


def main(argv: list[str] | None = None) -> None:
    """``python -m dflash.training.records ACTION``: the same as ``dflash records ACTION``, for
    the background job (it imports only the training side of the package)."""
    p = argparse.ArgumentParser(prog="dflash records", description=__doc__.splitlines()[0])
    run_records_cli(add_records_args(p).parse_args(argv))


if __name__ == "__main__":
    main()
