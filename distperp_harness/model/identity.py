"""Which weights a result came from: ``model_sha``, ``peft_sha``, ``delta_sha``, ``gguf_file`` and ``gguf_sha``.

Contracts:
* A hub id gives its commit (lm-eval ``hf``'s ``model_sha``): from the local hub cache when the snapshot is there
  (offline runs), else from ``HfApi().model_info`` when the hub may be asked; ``""`` when neither knows it (as
  ``hf`` records an unknown sha).
* A local folder or file gives ``"sha256:<hex>"``, a content hash: for a file, the SHA-256 of its bytes; for a
  folder, the SHA-256 of every regular file's relative path and SHA-256, in sorted order (hidden paths such as
  ``.git`` and ``.cache`` left out). Two folders with the same files hash alike wherever they live; one changed
  byte changes the hash. A GGUF checkpoint's ``model_sha`` is its file's hash (its weights and tokenizer are all
  in that file; a folder of several GGUF quantizations is not hashed whole).
* File hashes are memoized per ``(path, size, mtime)`` within the process.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from distperp_harness.options import Options

_FILE_HASHES: dict[tuple[str, int, int], str] = {}
CHUNK = 1 << 22


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the file's bytes (memoized per path, size and modification time)."""
    path = os.path.realpath(path)
    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                digest.update(block)
        _FILE_HASHES[key] = digest.hexdigest()
    return _FILE_HASHES[key]


def content_hash(path: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` of a local file or folder (module doc)."""
    root = Path(os.path.expanduser(path))
    if root.is_file():
        return "sha256:" + file_sha256(root)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        digest.update(f"{rel.as_posix()}\0{file_sha256(file)}\n".encode())
    return "sha256:" + digest.hexdigest()


def hub_sha(repo_id: str, revision: str = "main") -> str:
    """The hub commit of ``repo_id`` at ``revision`` (module doc); ``""`` when unknown."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if cached is None or not isinstance(cached, str):
            cached = try_to_load_from_cache(repo_id, "adapter_config.json", revision=revision)
        if isinstance(cached, str) and "/snapshots/" in cached:
            return cached.split("/snapshots/")[1].split("/")[0]
    except Exception:  # an unusual cache layout: ask the hub below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return ""
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id=repo_id, revision=revision).sha or ""
    except Exception:  # as lm-eval hf: an unknown sha is recorded as ""
        return ""


def _hub_file(repo_id: str, filename: str, revision: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        return cached if isinstance(cached, str) else None
    except Exception:
        return None


def source_sha(name: str, revision: str = "main", subfolder: str | None = None) -> str:
    """``model_sha`` of a hub id or local path (module doc); ``subfolder`` narrows a local folder's hash."""
    local = os.path.expanduser(name)
    if os.path.exists(local):
        return content_hash(os.path.join(local, subfolder) if subfolder else local)
    return hub_sha(name, revision)


def gguf_path(pretrained: str, gguf_file: str, revision: str = "main", subfolder: str | None = None) -> str | None:
    """The GGUF file's path on this machine (a local folder's, or the hub cache's), or None."""
    local = os.path.expanduser(pretrained)
    if os.path.isdir(local):
        return os.path.join(local, subfolder or "", gguf_file)
    return _hub_file(pretrained, f"{subfolder}/{gguf_file}" if subfolder else gguf_file, revision)


def checkpoint_identity(options: Options) -> dict[str, str]:
    """The identity keys of ``options``' checkpoint, as lm-eval ``hf`` names them (plus ``gguf_file``/``gguf_sha``,
    ``subfolder``): ``model_sha`` always; ``peft_sha``, ``delta_sha``, ``gguf_*`` when those keys are given."""
    if getattr(options, "in_memory", False):
        return {"model_sha": ""}
    info: dict[str, str] = {}
    if options.gguf_file:
        path = gguf_path(options.pretrained, options.gguf_file, options.revision, options.subfolder)
        gguf = "sha256:" + file_sha256(path) if path and os.path.isfile(path) else ""
        local = os.path.isdir(os.path.expanduser(options.pretrained))
        info["model_sha"] = gguf if local else hub_sha(options.pretrained, options.revision)
        info["gguf_file"] = options.gguf_file
        info["gguf_sha"] = gguf
    else:
        info["model_sha"] = source_sha(options.pretrained, options.revision, options.subfolder)
    if options.subfolder:
        info["subfolder"] = options.subfolder
    if options.peft:
        info["peft_sha"] = source_sha(options.peft, options.revision)
    if options.delta:
        info["delta_sha"] = source_sha(options.delta, options.revision)
    return info
