"""A read-only Hugging Face hub endpoint on loopback: the download protocol, nothing more.

`publish_model()` lays a folder into a hub root; `serve()` answers what huggingface_hub asks of
model and dataset repos: info, trees, HEAD/GET `resolve/{rev}/{file}` with ETag, X-Repo-Commit and
ranges, the hub's 404 codes. Large files act like LFS. Not emulated: Xet, CDN redirects, auth."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from diag.files import atomic_file, atomic_folder, file_digests, git_blob_sha1

# root/<org>/<name>/commits/<sha>/ (files + .diag-manifest.json), refs/<revision> (its sha); a
# plain folder root/<org>/<name>/ is served as "main". Datasets: the same under root/datasets/.
_MANIFEST = ".diag-manifest.json"
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".onnx", ".msgpack")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def _file_entry(path: Path, rel: str) -> dict[str, Any]:
    size = path.stat().st_size
    lfs = rel.endswith(_LFS_SUFFIXES) or size > 10 * 2**20
    digests = file_digests(path, "sha256", *(() if lfs else ("git-sha1",)))
    entry = {"size": size, "sha256": digests["sha256"], "lfs": lfs}
    if not lfs:
        return {**entry, "blob_id": digests["git-sha1"]}
    # the git blob of an LFS file is its pointer, as on the real hub
    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{entry['sha256']}\n"
               f"size {size}\n").encode()
    return {**entry, "blob_id": git_blob_sha1(pointer), "pointer_size": len(pointer)}


def _manifest_for(folder: Path, repo_id: str) -> dict[str, Any]:
    files = {p.relative_to(folder).as_posix(): _file_entry(p, p.relative_to(folder).as_posix())
             for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".diag-")}
    digest = hashlib.sha1(  # content-addressed: same files, same commit
        (repo_id + "".join(f"\n{rel} {e['sha256']}" for rel, e in files.items())).encode())
    return {"repo_id": repo_id, "commit": digest.hexdigest(), "files": files,
            "last_modified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())}


def publish_model(src_dir: str | os.PathLike[str], hub_root: str | os.PathLike[str], repo_id: str,
                  revision: str = "main") -> str:
    """Lay `src_dir` into the hub at `repo_id`@`revision` (each appears whole); its commit sha."""
    src, root = Path(src_dir), Path(hub_root)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id={repo_id!r}: must look like 'org/name'")
    if not src.is_dir():
        raise ValueError(f"src_dir={str(src)!r}: not a folder")
    manifest = _manifest_for(src, repo_id)
    commit, repo = manifest["commit"], root / repo_id
    if not (final := repo / "commits" / commit).exists():
        # content-addressed: a concurrent publish of the same content that won is identical
        with atomic_folder(final, replace=False) as tmp:
            for rel in manifest["files"]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src / rel, tmp / rel)
                except OSError:
                    shutil.copy2(src / rel, tmp / rel)
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
    with atomic_file(repo / "refs" / quote(revision, safe="")) as tmp_ref:
        tmp_ref.write_text(commit)
    return commit


class _HubError(Exception):
    def __init__(self, code: str, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.code, self.commit = code, commit


_MANIFESTS: dict[Path, dict[str, Any]] = {}  # read or hashed once (a race: twice, same result)


def _resolve(root: Path, repo_id: str, revision: str) -> tuple[Path, dict[str, Any]]:
    """repo@revision under root -> (its commit folder, manifest)."""
    parts = repo_id.split("/")
    folder = repo = root.joinpath(*parts)
    if len(parts) != 2 or not all(parts) or ".." in parts or parts[0] == "." or not repo.is_dir():
        raise _HubError("RepoNotFound", f"Repository {repo_id} not found")
    plain = not (repo / "refs").is_dir()  # a plain folder: one revision, "main"
    if not plain:
        if not (_SHA_RE.match(revision) and (repo / "commits" / revision).is_dir()):
            ref = repo / "refs" / quote(revision, safe="")
            if not ref.is_file():
                raise _HubError("RevisionNotFound", f"Invalid rev id: {revision}")
            revision = ref.read_text().strip()
        folder = repo / "commits" / revision
    if folder not in _MANIFESTS:
        _MANIFESTS[folder] = (_manifest_for(folder, repo_id) if plain
                              else json.loads((folder / _MANIFEST).read_text()))
    if plain and revision not in ("main", _MANIFESTS[folder]["commit"]):
        raise _HubError("RevisionNotFound", f"Invalid rev id: {revision}")
    return folder, _MANIFESTS[folder]


def _lfs(e: dict[str, Any], sha: str) -> dict[str, Any]:
    return {sha: e["sha256"], "size": e["size"], "pointerSize": e["pointer_size"]}


def _tree(manifest: dict[str, Any], prefix: str, recursive: bool) -> list[dict[str, Any]]:
    files, commit = manifest["files"], manifest["commit"]
    base = prefix.strip("/") + "/" if prefix.strip("/") else ""
    under = [p for p in files if p.startswith(base) and (recursive or "/" not in p[len(base):])]
    if base and not any(p.startswith(base) for p in files):
        raise _HubError("EntryNotFound", f"{prefix} does not exist on {commit}", commit)
    dirs = {"/".join(p.split("/")[:i]) for p in files if p.startswith(base)
            for i in range(1, p.count("/") + 1)}
    dirs = {d for d in dirs if d.startswith(base) and (recursive or "/" not in d[len(base):])}
    return [{"type": "directory", "path": d, "size": 0,
             "oid": hashlib.sha1(f"{commit}:{d}".encode()).hexdigest()} for d in sorted(dirs)] + [
        {"type": "file", "path": p, "size": files[p]["size"], "oid": files[p]["blob_id"],
         **({"lfs": _lfs(files[p], "oid")} if files[p]["lfs"] else {})} for p in under]


def _model_info(repo_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
    siblings = [{"rfilename": p, "size": e["size"], "blobId": e["blob_id"],
                 **({"lfs": _lfs(e, "sha256")} if e["lfs"] else {})}
                for p, e in manifest["files"].items()]
    stamp = manifest["last_modified"]
    return {"_id": manifest["commit"][:24], "id": repo_id, "modelId": repo_id,
            "sha": manifest["commit"], "private": False, "gated": False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers",
            "createdAt": stamp, "lastModified": stamp, "siblings": siblings}


def serve(root: Path, host: str, port: int) -> None:
    """Serve the hub download protocol until killed (the HubServer subprocess runs this)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    roots = {"models": root, "datasets": root / "datasets"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real hub; every reply sets a length

        def log_message(self, fmt: str, *args: Any) -> None:
            pass  # quiet: a download asks hundreds of times

        def do_GET(self) -> None:
            self._route(body=self.command == "GET")

        do_HEAD = do_GET

        def _reply(self, status: int, headers: dict[str, str], body: bool, payload: bytes = b"",
                   length: int | None = None) -> None:
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(length or len(payload))}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _json(self, obj: Any, body: bool) -> None:
            self._reply(200, {"Content-Type": "application/json"}, body, json.dumps(obj).encode())

        def _route(self, body: bool) -> None:
            url = urlsplit(self.path)
            segs = [unquote(s) for s in url.path.split("/")[1:]]
            query = parse_qs(url.query)
            kind = "datasets" if segs[:1] == ["datasets"] or segs[1:2] == ["datasets"] else "models"
            segs = segs[1:] if segs[:1] == ["datasets"] else segs
            try:
                if segs[:2] == ["api", kind] and len(segs) >= 4:
                    repo_id, rest = "/".join(segs[2:4]), segs[4:]
                    if not rest or (rest[0] == "revision" and len(rest) == 2):
                        _, manifest = _resolve(roots[kind], repo_id, rest[1] if rest else "main")
                        return self._json(_model_info(repo_id, manifest), body)
                    if rest[0] == "tree" and len(rest) >= 2:
                        _, manifest = _resolve(roots[kind], repo_id, rest[1])
                        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                        return self._json(_tree(manifest, "/".join(rest[2:]), recursive), body)
                elif len(segs) >= 5 and segs[2] == "resolve":
                    return self._file(roots[kind], "/".join(segs[:2]), segs[3],
                                      "/".join(segs[4:]), body)
                elif segs[:1] == ["api"] or (len(segs) >= 3 and "resolve" in segs[:4]):
                    # spaces, one-segment ids: not served here, so "not found"
                    raise _HubError("RepoNotFound", f"Repository for {url.path} not found")
                self._reply(404, {"Content-Type": "text/plain"}, body, b"Not Found")
            except _HubError as e:
                headers = {"X-Error-Code": e.code, "X-Error-Message": str(e),
                           "Content-Type": "application/json",
                           **({"X-Repo-Commit": e.commit} if e.commit else {})}
                self._reply(404, headers, body, json.dumps({"error": str(e)}).encode())

        def _file(self, root: Path, repo_id: str, revision: str, rel: str, body: bool) -> None:
            folder, manifest = _resolve(root, repo_id, revision)
            entry = manifest["files"].get(rel)
            if entry is None:
                raise _HubError("EntryNotFound", f"{rel} does not exist on {revision}",
                                manifest["commit"])
            size = entry["size"]
            # LFS files: ETag is the content's sha256, so a cache blob is named by its hash
            etag = entry["sha256"] if entry["lfs"] else entry["blob_id"]
            headers = {"X-Repo-Commit": manifest["commit"], "ETag": f'"{etag}"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if entry["lfs"]:
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(size)})
            start, end, status = 0, size - 1, 200
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
            if m and (m[1] or m[2]):
                if m[1]:
                    start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
                else:  # suffix range: the last N bytes
                    start = max(size - int(m[2]), 0)
                if start >= size or start > end:
                    headers["Content-Range"] = f"bytes */{size}"
                    return self._reply(416, headers, body)
                status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
            self._reply(status, headers, False, length=end - start + 1)
            if body and end >= start:
                with open(folder / rel, "rb") as f:
                    self.connection.sendfile(f, start, end - start + 1)  # zero-copy

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # parallel downloads open many connections at once

    Server((host, port), Handler).serve_forever()


if __name__ == "__main__":  # HubServer's subprocess: python -m diag.embedded.hub ROOT HOST PORT
    serve(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
