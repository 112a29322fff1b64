"""A target sharded over ``mx.distributed``: DFlash across two to four machines.

Started under ``mlx.launch`` (``mlx.launch -n 2 --backend ring python -m dflash generate ...``),
every rank loads the target with mlx-lm's own tensor-parallel sharding (``sharded_load`` and the
model class's ``shard()``: llama, qwen3 and qwen3_5; nothing here splits a weight itself) and the
whole drafter. Started without it (or with one rank) everything runs unsharded, as always; a launch
of one rank says so once.

Tensor-parallel by default: the drafter reads the outputs of chosen target layers. Under tensor
parallelism every decoder layer ends with an all-sum (its ``o_proj``/``down_proj``/``out_proj``
are "sharded-to-all"), so the hidden state after each layer is the full one and the same on every
rank: dflash's own layer walk (:func:`dflash.target.forward`) taps it unchanged, the verify pass,
acceptance and roll-back (GatedDeltaNet states included: each rank replays its own heads'
recurrence) run identically everywhere.

Pipeline-parallel on request (``--pipeline``; qwen3_5 and qwen3_next, the hybrid families whose
mlx-lm pipeline dflash's walk follows; qwen3_next has no tensor-parallel ``shard()`` in mlx-lm, so
this is its only split): mlx-lm's ``sharded_load(pipeline_group=...)`` gives
each rank a stage of consecutive layers. The walk then runs the stage in mlx-lm's send/receive
schedule and folds the taps each stage holds into the all-gather mlx-lm ends a pass with
(:func:`dflash.target._walk`), so every rank still leaves each pass with the same final hidden
state and taps, and everything after the pass (drafting, acceptance, plans) is as under tensor
parallelism; caches are the stage's own and roll back locally. It costs ``N - 1`` hops and one
all-gather a pass instead of ``2 L`` all-sums, but the stages run one after another.

Why the drafter runs on every rank: its block pass is small (one or a few layers over the block's
rows), and given identical inputs (the tapped hidden states and tokens, identical on every rank) it
computes identical proposals everywhere with no communication at all; the ranks run it in
parallel, so it costs no more wall time than on one rank. Computing it on rank 0 and broadcasting
the proposals would add one collective per cycle (a latency the link charges whatever the size)
while the other ranks idle. What this needs: the same MLX, mlx-lm and dflash on every rank and the
same checkpoints (compared at start, :func:`check_same_files`). Sampling draws from a seeded
generator; an unseeded sampled run takes rank 0's seed on every rank (:func:`agreed_settings`), so
every rank draws the same numbers.

Why rank 0 plans each cycle and the others take its plan: every rank must verify the same rows
each cycle (a pass is a sequence of collectives of that shape), and the ``auto`` and ``tree``
policies price plans with this machine's learnt pass timings, which differ between ranks. Two ways
to agree, with what each costs in communication:

* rank 0 runs the policy exactly as one process does (its timings, calibration, pair memory) and
  hands each decision to the others (:mod:`dflash.policy.agreed`): one all-sum of a fixed-size
  int32 array per decision, the others adding zeros; a cycle that drafts takes two (the rows to
  draft before, the plan after), one that does not (a plain stretch, a continuation of the
  context) one, and a plain step one more only where the context offers a continuation to weigh.
  Against the ``2 L`` all-sums of every verify pass (one after each attention or GatedDeltaNet
  block, one after each MLP) that is two link latencies more per cycle; the message is smaller
  than one verify row's activations (docs/distributed.md puts numbers on both).
* every rank prices with the same numbers (rank 0's timings sent to all): no collective per
  cycle, but the prices would have to stay frozen between agreed refreshes (the policy learns
  from each pass on one process), every other input of the plan (the pair memory and the stored
  cost calibration each machine reads from its own disk) would have to be sent too, and one
  rank-local input overlooked later would not fail but hang the ranks in mismatched collectives.

The first is chosen: its cost is small and counted, and it cannot diverge by construction: the
other ranks never price anything; a tree or a continuation travels with every token and parent it
verifies, and a chain names its rows of the drafted block, which is the same on every rank (same
inputs, same rows, the same number of candidates read, all sent before drafting). The batched
engine's ``auto`` (whether a pass drafts, its rows and width, the rows that verify a
continuation) prices with timings too and is handed over the same way
(:func:`dflash.policy.agreed.agreed_batch`), ``dflash serve``'s batches included.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np

from .console import say_once
from .errors import ModelLoadError, UnsupportedTargetError
from .ranks import Ranks, init_ranks

# mlx-lm model modules whose tensor-parallel shard() dflash's layer walk runs unchanged.
TENSOR_PARALLEL = ("llama", "qwen3", "qwen3_5")
# ... and those whose pipeline() split it runs by stages: their stage schedule (receive, layers,
# send held by the last cache, one all-gather) is the one the walk follows, and their GatedDeltaNet
# front ends (qwen3_5's in_proj_qkv, qwen3_next's in_proj_qkvz) are both recorded and rolled back.
# qwen3_next splits by layers only: its mlx-lm class has no shard().
PIPELINE_PARALLEL = ("qwen3_5", "qwen3_next")
_LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# Fingerprint reads of each checkpoint file: its head and tail and evenly spaced chunks between.
_CHUNK = 1 << 20
_CHUNKS = 8


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or ``mpirun``), without joining it."""
    return any(v in os.environ for v in _LAUNCH_VARS)


def launch_rank() -> int:
    """This process's rank as the launcher set it (0 when not launched), without joining it."""
    for v in _LAUNCH_VARS:
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 0


def join() -> Ranks:
    """The ranks of this launch (one rank when not launched; a launch of one rank says so once)."""
    try:
        found = init_ranks()
    except RuntimeError:
        if not launched():
            raise
        found = Ranks()  # mlx.launch -n 1 writes a hostfile MLX's ring backend cannot read
    if not found.distributed and launched():
        say_once("distributed-one-rank",
                 "a launch of one rank: the target runs unsharded on this process")
    return found


# ---------------------------------------------------------------------------------------------
# What mlx-lm can shard


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def model_family(path: str | Path) -> str:
    """The mlx-lm model module that loads ``path`` (``llama``, ``qwen3``, ...)."""
    from mlx_lm.utils import load_config

    config = load_config(Path(path))
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError as e:
        raise UnsupportedTargetError(f"--model {path}: {e}") from None
    return model_class.__module__.rsplit(".", 1)[-1]


def check_shardable(path: str | Path, size: int, pipeline: bool = False) -> None:
    """Raise ``UnsupportedTargetError`` naming the family or the count when mlx-lm cannot split
    the target at ``path`` over ``size`` ranks the way dflash runs it (tensor-parallel; with
    ``pipeline``, by layers)."""
    from mlx_lm.utils import load_config

    family = model_family(path)
    config = _text_config(load_config(Path(path)))
    if pipeline:
        check_pipeline(path, family, config, size)
        return
    supported = ", ".join(TENSOR_PARALLEL)
    if family not in TENSOR_PARALLEL:
        by_layers = (f"; {family} splits by layers with --pipeline"
                     if family in PIPELINE_PARALLEL else
                     f"; by layers (--pipeline): {', '.join(PIPELINE_PARALLEL)}")
        raise UnsupportedTargetError(
            f"--model {path}: model family {family!r} cannot be sharded for speculative decoding; "
            f"supported: {supported} (mlx-lm's tensor-parallel sharding){by_layers}")
    counts = {"num_attention_heads": config.get("num_attention_heads"),
              "intermediate_size": config.get("intermediate_size")}
    kv = config.get("num_key_value_heads") or config.get("num_attention_heads")
    if family == "qwen3_5":
        counts.update(linear_num_key_heads=config.get("linear_num_key_heads"),
                      linear_num_value_heads=config.get("linear_num_value_heads"))
        if not config.get("tie_word_embeddings", True):
            counts["vocab_size"] = config.get("vocab_size")
        if kv and kv < size and size % kv:  # mlx-lm repeats KV heads when there are fewer
            counts["num_key_value_heads"] = kv
        elif kv and kv >= size:
            counts["num_key_value_heads"] = kv
    else:
        counts["num_key_value_heads"] = kv
    for name, value in counts.items():
        if value and value % size:
            raise UnsupportedTargetError(
                f"--model {path}: {name}={value} is not divisible by {size} ranks; mlx-lm's "
                f"tensor-parallel sharding ({family}) splits it evenly over the ranks "
                f"(supported: {supported} with every split count divisible by the rank count)")


def check_pipeline(path: str | Path, family: str, config: dict, size: int) -> None:
    """``UnsupportedTargetError`` naming what stops mlx-lm's split by layers of ``path`` over
    ``size`` ranks from running under dflash: the family, too few layers, or a checkpoint
    without the index ``sharded_load`` reads each stage's files from."""
    if family not in PIPELINE_PARALLEL:
        raise UnsupportedTargetError(
            f"--model {path}: model family {family!r} cannot be split by layers (--pipeline) for "
            f"speculative decoding; supported: {', '.join(PIPELINE_PARALLEL)} (mlx-lm's pipeline "
            "splits whose stage schedule dflash's layer walk follows)")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and layers < size:
        raise UnsupportedTargetError(
            f"--model {path}: num_hidden_layers={layers} cannot be split by layers over {size} "
            "ranks (mlx-lm's pipeline split needs at least one layer per rank)")
    if Path(path).is_dir() and not (Path(path) / "model.safetensors.index.json").is_file():
        raise UnsupportedTargetError(
            f"--model {path}: no model.safetensors.index.json; mlx-lm's pipeline split "
            "(--pipeline) reads each stage's weight files from it (mlx_lm.convert writes one)")


def load_target(path: str | Path, ranks: Ranks, pipeline: bool = False) -> tuple:
    """The target at ``path`` sharded over ``ranks`` by mlx-lm's ``sharded_load`` (tensor
    parallel; with ``pipeline``, by layers), ready for this machine's backend, and its
    tokenizer."""
    from mlx_lm.utils import sharded_load

    from . import backend

    backend.configure()
    check_shardable(path, ranks.size, pipeline)
    if pipeline:
        model, tokenizer = sharded_load(str(path), pipeline_group=ranks.group)
    else:
        model, tokenizer = sharded_load(str(path), tensor_group=ranks.group)
    backend.prepare_for_backend(model)
    return model, tokenizer


def _stage_ranks(model) -> tuple[int, int] | None:
    """This rank and the rank count of a target split by layers (``model``: mlx-lm's model or
    dflash's ``TargetParts``); ``None``: not split by layers."""
    stage = getattr(model, "stage", None)
    if stage is not None and hasattr(stage, "size"):
        return int(stage.rank), int(stage.size)
    inner = getattr(model, "model", None)
    size = getattr(inner, "pipeline_size", 1)
    if isinstance(size, int) and size > 1:
        return int(inner.pipeline_rank), size
    return None


def _shard_group(model):
    """The group mlx-lm's sharded layers of ``model`` reduce over (``AllToShardedLinear``/
    ``ShardedToAllLinear``, a GatedDeltaNet's ``sharding_group``); ``None``: not split."""
    layers = getattr(model, "layers", None) or []
    for module in (layers[0].modules() if layers else []):
        group = getattr(module, "group", None) or getattr(module, "sharding_group", None)
        if group is not None and hasattr(group, "size"):
            return group
    return None


def shard_count(model) -> int:
    """Over how many ranks mlx-lm split ``model`` (1: not split)."""
    staged = _stage_ranks(model)
    if staged is not None:
        return staged[1]
    group = _shard_group(model)
    return 1 if group is None else int(group.size())


def model_ranks(model) -> Ranks:
    """The ranks ``model`` is split over, this process's place among them (one rank of one:
    not split). What a generation's decisions must agree over: the group its passes reduce in
    (split by layers: the global group, over which mlx-lm's stages send and gather)."""
    staged = _stage_ranks(model)
    if staged is not None:
        import mlx.core as mx

        return Ranks(staged[0], staged[1], mx.distributed.init())
    group = _shard_group(model)
    if group is None or group.size() <= 1:
        return Ranks()
    return Ranks(int(group.rank()), int(group.size()), group)


# ---------------------------------------------------------------------------------------------
# Every rank loads the same files


def file_digest(path: Path) -> bytes:
    """A 16-byte fingerprint of one file: its size, its first and last MiB and evenly spaced MiB
    between (a whole file when small). Reading every byte of a many-gigabyte checkpoint on every
    rank at each start would cost minutes; a different export or a partial copy differs here."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= (_CHUNKS + 2) * _CHUNK:
            h.update(f.read())
        else:
            for start in np.linspace(0, size - _CHUNK, _CHUNKS + 2).astype(np.int64):
                f.seek(int(start))
                h.update(f.read(_CHUNK))
    return h.digest()


def folder_digests(path: str | Path, option: str) -> dict[str, bytes]:
    """``"--model config.json"``-style names to fingerprints for the checkpoint files of a model
    folder (a Hugging Face repo id: its name, the files are fetched per rank)."""
    p = Path(path)
    if not p.is_dir():
        return {f"{option} {path}": hashlib.blake2b(str(path).encode(), digest_size=16).digest()}
    wanted = (".safetensors", ".json", ".gguf", ".npz", ".model", ".tiktoken", ".jinja")
    return {f"{option} {f.name}": file_digest(f) for f in sorted(p.iterdir())
            if f.is_file() and f.name.endswith(wanted)}


def software_digests() -> dict[str, bytes]:
    """The versions whose arithmetic must agree for the ranks to draft and decide identically."""
    from importlib.metadata import version

    names = {}
    for package in ("mlx", "mlx-lm", "dflash"):
        try:
            text = version(package)
        except Exception:  # not installed as a distribution (a source checkout)
            text = "unknown"
        names[f"{package} version"] = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return names


def _rows(table: dict[str, bytes]) -> np.ndarray:
    """One int32 row per entry: 16 bytes of the name's hash, then the 16-byte fingerprint."""
    rows = [np.frombuffer(hashlib.blake2b(name.encode(), digest_size=16).digest() + digest,
                          dtype=np.int32) for name, digest in table.items()]
    return np.stack(rows) if rows else np.zeros((0, 8), dtype=np.int32)


def mismatches(tables: list[np.ndarray], names: dict[bytes, str]) -> list[str]:
    """What each rank's table (``_rows``) disagrees on with rank 0's, as readable lines."""
    def as_dict(table):
        return {row[:4].tobytes(): row[4:].tobytes() for row in table if row.any()}

    first, found = as_dict(tables[0]), []
    for r, table in enumerate(tables[1:], start=1):
        other = as_dict(table)
        for key in sorted(set(first) | set(other)):
            label = names.get(key, "a file rank 0 does not name")
            if key not in other:
                found.append(f"rank {r} lacks {label}")
            elif key not in first:
                found.append(f"rank {r} has {label}, rank 0 does not")
            elif first[key] != other[key]:
                found.append(f"rank {r} has a different {label} than rank 0")
    return found


def check_same_files(ranks: Ranks, model: str | Path, draft: str | Path) -> None:
    """Compare the fingerprints of the target's and the drafter's checkpoint files (and the
    software versions) across the ranks: one all-gather; ``ModelLoadError`` naming the rank and
    the file where they differ, raised on every rank."""
    if not ranks.distributed:
        return
    import mlx.core as mx

    table = {**software_digests(), **folder_digests(model, "--model"),
             **folder_digests(draft, "--draft")}
    names = {hashlib.blake2b(n.encode(), digest_size=16).digest(): n for n in table}
    rows = _rows(table)
    width = ranks.from_max(len(rows))
    padded = np.zeros((width, 8), dtype=np.int32)
    padded[:len(rows)] = rows
    every = np.array(mx.distributed.all_gather(mx.array(padded), group=ranks.group))
    found = mismatches(np.split(every, ranks.size), names)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ModelLoadError(f"the ranks load different checkpoints: {found[0]}{more}; every rank "
                             "must load the same --model and --draft files")


# ---------------------------------------------------------------------------------------------
# Decisions every rank takes alike


def agreed_settings(ranks: Ranks, settings: dict) -> dict:
    """Generation ``settings`` (``stream_generate`` keywords) every rank decides alike under:
    without a seed, rank 0's seed, taken by every rank (one all-sum), so sampled runs draw the
    same numbers everywhere. The verify policy is left as given: policies that plan from this
    machine's timings (``auto``, ``tree``) plan on rank 0 and hand each plan to the other ranks
    (:mod:`dflash.policy.agreed`)."""
    if not ranks.distributed:
        return settings
    out = dict(settings)
    if out.get("seed") is None:
        out["seed"] = ranks.from_main(random_seed())
    return out


def random_seed() -> int:
    """A fresh sampling seed (non-negative int32), for rank 0 to hand to every rank."""
    return int.from_bytes(os.urandom(4), "little") >> 1


def text_from_main(ranks: Ranks, read) -> str | None:
    """What ``read()`` returns on rank 0 (``None`` for end of input: ``read`` raised
    ``EOFError``), on every rank; the other ranks do not call it. Two all-sums: the length, then
    the bytes."""
    if not ranks.distributed:
        try:
            return read()
        except EOFError:
            return None
    import mlx.core as mx

    data = None
    if ranks.is_main:
        try:
            data = read().encode()
        except EOFError:
            data = None
    size = ranks.from_main(-1 if data is None else len(data))
    if size < 0:
        return None
    mine = np.frombuffer(data, dtype=np.uint8).astype(np.int32) if ranks.is_main \
        else np.zeros(size, dtype=np.int32)
    every = np.array(mx.distributed.all_sum(mx.array(mine), group=ranks.group))
    return every.astype(np.uint8).tobytes().decode()


def call_to_followers(ranks: Ranks, call: dict | None) -> None:
    """Rank 0 hands ``call`` (JSON-able; ``None``: no more calls) to every other rank, which
    receives it with :func:`call_from_main`. Two all-sums, as :func:`text_from_main`."""
    def read() -> str:
        if call is None:
            raise EOFError
        return json.dumps(call)

    text_from_main(ranks, read)


def call_from_main(ranks: Ranks) -> dict | None:
    """The call rank 0 handed over with :func:`call_to_followers` (``None``: no more calls);
    blocks until rank 0 sends one."""
    def read() -> str:  # called on rank 0 only, which sends with call_to_followers instead
        raise EOFError

    text = text_from_main(ranks, read)
    return None if text is None else json.loads(text)


def other_ranks(ranks: Ranks) -> str:
    """How an error names the ranks other than rank 0: ``rank 1``, or ``one of ranks 1-3``."""
    return "rank 1" if ranks.size == 2 else f"one of ranks 1-{ranks.size - 1}"


class _Discard:
    """A text stream that drops what is written (the other ranks' copies of rank 0's output)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def quiet_other_ranks() -> int:
    """Under a launch, let only rank 0 print: the others' stdout and stderr are dropped (their
    errors still reach ``sys.__stderr__``, see :func:`error_stream`). Returns this rank."""
    rank = launch_rank()
    if launched() and rank != 0:
        sys.stdout = _Discard()
        sys.stderr = _Discard()
        # An unexpected failure on this rank still shows its traceback.
        sys.excepthook = lambda kind, value, tb: traceback.print_exception(
            kind, value, tb, file=sys.__stderr__)
    return rank


def error_stream():
    """Where a command's error line goes: stderr, on every rank."""
    return sys.__stderr__ if isinstance(sys.stderr, _Discard) else sys.stderr


def _split_words(pipeline: bool) -> str:
    return "pipeline-parallel (by layers)" if pipeline else "tensor-parallel"


def split_name(model) -> str:
    """How mlx-lm split ``model`` over the ranks, in words: by layers or tensor-parallel."""
    return _split_words(_stage_ranks(model) is not None)


def describe(ranks: Ranks, pipeline: bool = False) -> str:
    """One line for the log: how the target is split."""
    return (f"target sharded {_split_words(pipeline)} over {ranks.size} ranks "
            f"(this is rank {ranks.rank})")


# The split ``dflash`` commands load a sharded target with when their caller does not say
# (the command line's ``--pipeline``).
_split = {"pipeline": False}


def choose_pipeline(pipeline: bool) -> None:
    """Make this process load sharded targets by layers (``True``) or tensor-parallel."""
    _split["pipeline"] = bool(pipeline)


def pipeline_chosen() -> bool:
    """Whether sharded targets load by layers when the caller does not say (:func:`choose_pipeline`)."""
    return _split["pipeline"]
