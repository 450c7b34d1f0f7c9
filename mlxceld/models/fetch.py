"""A model named by its Hugging Face repo id: fetch what this host needs of it, no more.

A model is a local directory or, when no such path exists, a Hugging Face repo
id (``owner/name``: ``--model``, ``[serve] model``, the cluster TOML's
``model``, ``mlxctl serve``, ``mlxctl cluster plan|activate``). It is fetched in
two steps, each one ``huggingface_hub.snapshot_download`` with
``allow_patterns``, each logged as it starts and ends:

1. ``local_model(name)``: ``METADATA_PATTERNS``, config.json, the safetensors
   index, the tokenizer and chat template files; what every host holds, and
   what the model identity is made of (``identity.py``), enough to check the
   family, count the layers and take part in a plan. The daemon does it once
   per model and process (at start-up for its flags and config file: an error
   there exits 2), and everything else reads the snapshot directory it returns
   as any other local directory (one holding only some shards).
2. ``fetch_stage(path, layers)``: in the stage worker, before it loads, the
   shards that hold what its stage keeps (``shards.stage_files``, read from the
   index fetched in step 1) that the snapshot lacks, at the snapshot's own
   commit, with their bytes reported to ``progress`` (the stage's ``loading``
   stat: ``downloading 43% of 61.0 GiB, 12 s`` in ``mlxctl status``). The
   peer's wait on a loading stage (``LOAD_START_S``, ``LOAD_STALL_S`` in
   ``cluster/assignment/stagehost.py``) covers it: a download that advances is
   waited for, one that stalls fails the stage. A single host's router fetches
   the whole model so (``fetch_whole``: every file of the index), its progress
   in its own ``loading`` stat. ``fetch_model(name, layers)`` is both steps in
   one call.

The host that plans prices every layer from its shard's safetensors header
(``profile.py``); of a repo id's snapshot that lacks some shards (the
coordinator may hold none), ``hub_headers`` reads those shards' headers from the
Hub (huggingface_hub's ``get_safetensors_metadata``: a few KB per shard by
range requests, never the weights), kept per process; offline it is refused,
naming the shards.

Files land in huggingface_hub's cache: ``HF_HUB_CACHE``, by default
``$HF_HOME/hub`` (``~/.cache/huggingface/hub``); a file already there is not
fetched again. With ``HF_HUB_OFFLINE=1`` only the cache is read: a repo it does
not hold is refused naming it, and a stage whose shards it lacks fails naming
them, each with the ``hf download`` line that fetches them. A
private or gated repo needs a token: huggingface_hub's own token file
(``hf auth login``) or ``HF_TOKEN`` in the daemon's environment, which
reaches only the workers that download, on their stdin (``supervisor/process.py``:
``DOWNLOAD_ENV``), and is never written to argv, a child's environment, a log, an
event, the database or an error.

Every fetch is bounded by huggingface_hub's own timeouts (``HF_HUB_ETAG_TIMEOUT``
for a look-up, ``HF_HUB_DOWNLOAD_TIMEOUT`` for a read that stalls: 10 s each by
default); a stage's download also by the peer's ``LOAD_STALL_S``.

huggingface_hub is installed with mlx-lm (through transformers), and imported
only here, only when a repo id is fetched.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from mlxceld.errors import ConfigError
from mlxceld.models.identity import CONFIG, layer_count, read_model_config
from mlxceld.models.shards import missing_files, read_index, stage_files
from mlxceld.models.tensor_headers import DTYPE_BYTES, TensorEntry

log = logging.getLogger(__name__)

METADATA_PATTERNS: Final = ("*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                            "*.txt", "*.jsonl", "*.jinja")
ALL_WEIGHTS: Final = ("model*.safetensors",)  # what mlx-lm's load_model reads
# Hugging Face's own rule for a repo id: owner/name, letters, digits, '-', '_', '.'.
_REPO_ID: Final = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# huggingface_hub's cache: <cache>/models--owner--name/snapshots/<commit>/<file>.
_SNAPSHOT: Final = re.compile(r"models--(.+?)--(.+)")
TOKEN_ENV: Final = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")  # never echoed (``_scrub``)
WATCH_S: Final = 1.0  # between two looks at a download's cache (``DownloadHeard``)

Progress = Callable[[int, int], None]  # (bytes fetched, bytes to fetch)
# (repo id, commit, shard files) -> each file's tensors, from its safetensors header alone.
Headers = Callable[[str, str, Sequence[str]], dict[str, dict[str, TensorEntry]]]


class Download(Protocol):
    """Our seam over huggingface_hub: fetch the files of repo ``name`` matching
    ``patterns`` (at ``revision``, the default branch when None) into the cache, and
    return the snapshot directory; ``progress`` hears the bytes as they come."""

    def __call__(self, name: str, patterns: Sequence[str], *, revision: str | None = None,
                 progress: Progress | None = None) -> Path: ...


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face repo id (``owner/name``)."""
    return (_REPO_ID.fullmatch(name) is not None and ".." not in name
            and not name.endswith((".", "-")))


def names_a_repo(name: str) -> bool:
    """Whether model ``name`` is a Hugging Face repo id: no such local path, and it reads as
    one."""
    return is_repo_id(name) and not Path(name).expanduser().exists()


def snapshot_of(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) when ``path`` is a snapshot directory of huggingface_hub's cache
    (what ``local_model`` returns for a repo id), else None."""
    path = Path(path)
    m = _SNAPSHOT.fullmatch(path.parent.parent.name)
    if path.parent.name != "snapshots" or m is None:
        return None
    return f"{m.group(1)}/{m.group(2)}", path.name


def model_name(path: Path) -> str:
    """What a model directory is called: its repo id when it is a cache snapshot, else the
    path (what a pushed cluster TOML names, so that each host resolves it itself)."""
    snap = snapshot_of(path)
    return snap[0] if snap is not None else str(path)


def weight_patterns(path: Path, layers: tuple[int, int] | None) -> list[str]:
    """The weight files to fetch into ``path`` (which holds step 1's files) for a stage
    of ``layers``, or for the whole model (None); see the module docstring."""
    index = read_index(path)
    if layers is None or index is None:  # no index: one file, which every stage reads
        return list(ALL_WEIGHTS)
    config = read_model_config(path)
    start, end = layers
    return sorted(stage_files(index, config, start, end, layer_count(config)))


_local: dict[str, Path] = {}  # repo id -> its metadata snapshot, fetched by this process
_lock = threading.Lock()


def local_model(name: str, download: Download | None = None) -> Path:
    """The local directory of model ``name``: the snapshot of the Hugging Face repo
    ``name``'s metadata when no such path exists (step 1; fetched once per process while
    the snapshot stays on disk), else ``name`` as a path."""
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(name):  # a path: what reads it names what is wrong
        return path
    with _lock:
        known = _local.get(name)
    if known is not None and (known / CONFIG).is_file():
        return known
    local = fetch_metadata(name, download)
    with _lock:
        _local[name] = local
    return local


def fetch_metadata(name: str, download: Download | None = None) -> Path:
    """Step 1 for the repo ``name``: its snapshot directory, with what every host holds."""
    _require_repo_id(name)
    log.info("model %s: fetching its config, index and tokenizer", name)
    local = _fetch(download or _snapshot, name, METADATA_PATTERNS)
    if not (local / CONFIG).is_file():
        raise ConfigError(f"Hugging Face repo {name!r} has no {CONFIG}",
                          hint="is it an mlx-lm model? (mlx-community/... repos are)")
    log.info("model %s: config, index and tokenizer in %s", name, local)
    return local


def fetch_stage(path: Path, layers: tuple[int, int] | None,
                progress: Progress | None = None, download: Download | None = None) -> Path:
    """Step 2: the shards the stage of ``layers`` (None: the whole model, as a single
    host's router loads it) needs that the snapshot ``path`` lacks, fetched at its commit;
    ``path`` as it is when it lacks none, or is not a snapshot of the cache (a local
    directory: the load names what it lacks)."""
    path = Path(path)
    snap = snapshot_of(path)
    if snap is None:
        return path
    index = read_index(path)
    if index is None:
        lacking = [] if any(path.glob(ALL_WEIGHTS[0])) else weight_patterns(path, layers)
    else:
        needed = index.files if layers is None else frozenset(weight_patterns(path, layers))
        lacking = missing_files(path, needed)
    if not lacking:
        return path
    repo, commit = snap
    where = (f"model {repo}" if layers is None
             else f"stage layers [{layers[0]}, {layers[1]}) of {repo}")
    if offline():
        raise ConfigError(
            f"{where} need{'s' if layers is None else ''} {len(lacking)} file(s) that this "
            f"host's Hugging Face cache ({path}) lacks: {_some(lacking)}; HF_HUB_OFFLINE is "
            "set, so none is fetched",
            hint=f"download them first: hf download {repo} "
            f"{' '.join(lacking)} --revision {commit} (or unset HF_HUB_OFFLINE)")
    log.info("%s: fetching %d weight file(s): %s", where, len(lacking), _some(lacking))
    subject = "its weights" if layers is None else "its shards"
    local = _fetch(download or _snapshot, repo, lacking, revision=commit, progress=progress,
                   subject=f"{where}: {subject} {_some(lacking)}:")
    log.info("%s: fetched into %s", where, local)
    return local


def fetch_whole(name: str, progress: Progress | None = None,
                download: Download | None = None) -> Path:
    """A single host's model named by the repo id ``name``: its metadata (step 1), then
    every weight file its cache lacks (step 2 for the whole model), with progress."""
    return fetch_stage(local_model(name, download), None, progress, download)


def fetch_model(name: str, layers: tuple[int, int] | None = None,
                download: Download | None = None) -> Path:
    """The local directory of model ``name``: itself when it is a path that exists, else
    what this host needs of the Hugging Face repo ``name``: its metadata and the weights
    of the stage of ``layers``, or of every layer (None)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    get = download or _snapshot
    local = fetch_metadata(name, get)
    patterns = weight_patterns(local, layers)
    which = "every layer" if layers is None else f"layers [{layers[0]}, {layers[1]})"
    log.info("model %s: fetching %d weight file pattern(s) for %s: %s", name, len(patterns),
             which, _some(patterns))
    return _fetch(get, name, patterns)


_headers: dict[tuple[str, str], dict[str, dict[str, TensorEntry]]] = {}  # (repo, commit)


def hub_headers(repo: str, commit: str, files: Sequence[str],
                get: Headers | None = None) -> dict[str, dict[str, TensorEntry]]:
    """The tensors of the shards ``files`` of ``repo`` at ``commit``, read from the Hub's
    safetensors headers alone (a few KB per shard, never the weights): how the host that
    plans prices the layers whose shards it does not hold (``profile.py``). Kept per
    process; refused offline, naming the shards."""
    with _lock:
        known = _headers.get((repo, commit))
    if known is None or not set(files) <= known.keys():
        if offline():
            raise ConfigError(
                f"model {repo}: pricing its layers needs the headers of {len(files)} shard(s) "
                f"this host's Hugging Face cache lacks ({_some(files)}), and HF_HUB_OFFLINE "
                "is set", hint=f"download them first: hf download {repo} "
                f"{' '.join(files)} --revision {commit} (or unset HF_HUB_OFFLINE: the "
                "Hub's headers price them)")
        try:
            known = (get or _hub_headers)(repo, commit, files)
        except ConfigError:
            raise
        except Exception as exc:  # a foreign library's seam, as in _fetch
            what = _scrub(f"{type(exc).__name__}: {exc}".splitlines()[0])[:400]
            raise ConfigError(f"model {repo}: the safetensors headers of its shards cannot be "
                              f"read from Hugging Face: {what}",
                              hint="check this host's network, or fetch every shard on the "
                              f"host that plans: hf download {repo}") from exc
        with _lock:
            _headers[(repo, commit)] = known
    return {f: known[f] for f in files if f in known}


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` says to read only the cache (huggingface_hub's rule)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _require_repo_id(name: str) -> None:
    if not is_repo_id(name):
        raise ConfigError(f"model {name!r} is not a local directory, nor a Hugging Face "
                          "repo id (owner/name)",
                          hint="give the path of an mlx-lm model directory, or a repo id "
                          "such as mlx-community/Qwen3-4B-4bit")


def _fetch(get: Download, name: str, patterns: Sequence[str], *, revision: str | None = None,
           progress: Progress | None = None, subject: str | None = None) -> Path:
    """``get``, its failures translated once, here: huggingface_hub's errors (OSError,
    ValueError and httpx's own) name what failed, never the token. ``subject`` opens the
    message (default: the model is not a local directory)."""
    try:
        return Path(get(name, patterns, revision=revision, progress=progress))
    except Exception as exc:  # a foreign library's seam: every failure becomes ours
        kinds = {c.__name__ for c in type(exc).__mro__}
        what = _scrub(f"{type(exc).__name__}: {exc}".splitlines()[0])[:400]
        subject = subject or f"model {name!r} is not a local directory, and"
        if offline() or kinds & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"}:
            raise ConfigError(
                f"{subject} this host's Hugging Face cache does not hold it ({what})",
                hint=f"download it first with `hf download {name}` and pass "
                "the path it prints, or unset HF_HUB_OFFLINE on a host that can reach "
                "huggingface.co") from exc
        if kinds & {"RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"}:
            raise ConfigError(
                f"{subject} Hugging Face has no such repo this host may read ({what})",
                hint="check the repo id; a private or gated repo needs a token "
                "(`hf auth login`, or HF_TOKEN in the daemon's environment)"
                ) from exc
        raise ConfigError(f"{subject} cannot be fetched from Hugging Face: {what}",
                          hint="check the repo id and this host's network (offline, give a "
                          "local directory, or set HF_HUB_OFFLINE=1 to use the cache)"
                          ) from exc


def _scrub(text: str) -> str:
    """``text`` without the value of a token variable, should a library ever echo one."""
    for var in TOKEN_ENV:
        token = os.environ.get(var)
        if token and len(token) >= 4:
            text = text.replace(token, "<token>")
    return text


def _some(names: Sequence[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _hub_headers(repo: str, commit: str, files: Sequence[str]
                 ) -> dict[str, dict[str, TensorEntry]]:
    from huggingface_hub import get_safetensors_metadata

    meta = get_safetensors_metadata(repo, revision=commit)
    out: dict[str, dict[str, TensorEntry]] = {}
    for file, header in meta.files_metadata.items():
        out[file] = {}
        for name, t in header.tensors.items():
            if t.dtype not in DTYPE_BYTES:
                raise ValueError(f"{file}: tensor {name!r} has dtype {t.dtype!r}")
            begin, end = t.data_offsets
            out[file][name] = TensorEntry(name, t.dtype, tuple(t.shape), end - begin)
    return out


def _snapshot(name: str, patterns: Sequence[str], *, revision: str | None = None,
              progress: Progress | None = None) -> Path:
    from huggingface_hub import constants, snapshot_download

    if progress is None:
        return Path(snapshot_download(name, allow_patterns=list(patterns), revision=revision))
    owner, repo = name.split("/")
    heard = DownloadHeard(progress, Path(constants.HF_HUB_CACHE) / f"models--{owner}--{repo}"
                          / "blobs")
    watch = threading.Thread(target=heard.watch, name=f"fetch {name}", daemon=True)
    watch.start()
    try:
        return Path(snapshot_download(name, allow_patterns=list(patterns), revision=revision,
                                      tqdm_class=bytes_bar(heard.bar)))
    finally:
        heard.stop.set()
        watch.join(WATCH_S * 2)


class DownloadHeard:
    """What a download says to ``progress``: the bytes its bars count (``bytes_bar``), or,
    should a huggingface_hub version feed them none, how much its cache's blobs grew,
    looked at every ``WATCH_S`` (then the total is what has come so far): a download
    that advances always says so, and the stage waiting on it is not failed for
    silence (``LOAD_STALL_S``)."""

    def __init__(self, progress: Progress, blobs: Path) -> None:
        self._progress, self._blobs = progress, blobs
        self._lock = threading.Lock()
        self._bar = (0, 0)
        self._grown = 0
        self._base = self._on_disk()
        self.stop = threading.Event()

    def bar(self, done: int, total: int) -> None:
        with self._lock:
            self._bar = (done, total)
        self._say()

    def watch(self) -> None:
        while not self.stop.wait(WATCH_S):
            grown = self._on_disk() - self._base
            with self._lock:
                moved, self._grown = grown > self._grown, max(grown, self._grown)
            if moved:
                self._say()

    def _say(self) -> None:
        with self._lock:
            done = max(self._bar[0], self._grown)
            total = max(self._bar[1], done)
        self._progress(done, total)

    def _on_disk(self) -> int:
        """The bytes in the blobs directory, finished or not (``*.incomplete``)."""
        total = 0
        try:
            entries = list(os.scandir(self._blobs))
        except OSError:
            return 0
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
        return total


def bytes_bar(progress: Progress) -> type:
    """A stand-in for tqdm that hears snapshot_download's bytes written (its
    "Reconstructing" bar: each file adds its size to the total, each chunk its bytes
    done) and says them to ``progress``; the other bars (files, network bytes) are
    heard and dropped. Nothing is drawn."""
    lock = threading.Lock()

    class BytesBar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.counts = str(kwargs.get("desc", "")).startswith("Reconstructing")
            self.n = int(kwargs.get("initial", 0) or 0)
            self.total = int(kwargs.get("total", 0) or 0)
            self.format_dict: dict[str, Any] = {"rate": None}
            self._say()

        def _say(self) -> None:
            if self.counts:
                with lock:
                    progress(self.n, max(self.n, self.total))

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            self._say()

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            self._say()

        def __enter__(self) -> BytesBar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def close(self) -> None:
            return None

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            return None

        set_description_str = set_postfix_str = set_postfix = set_description

    return BytesBar
