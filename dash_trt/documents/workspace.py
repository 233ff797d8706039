"""``dash-trt ocr --out`` as a workspace: a manifest (``OUT/manifest.json``) naming each output's
input, so that a run started again skips the documents already written.

A document is the unit: one generation request reads all its pages (the page guard cuts the
answer into one section a page, the no-repeat window runs across page breaks, the instruction
depends on the page count), so generating only some of its pages again would not give the text
an uninterrupted run gives. Its files are written whole (a temporary file renamed into place,
:func:`~dash_trt.fileio.atomic_write`), every page file and then ``OUT/NAME.md``, and only then
is its entry written (the manifest itself written whole too). A run killed anywhere leaves either
an entry whose files are all there with the digests it records, or a document with no entry (or
an older entry whose digests no longer match): the next run trusts the first and writes the
second again.

The manifest (JSON; ``version`` 1)::

    {"version": 1, "documents": {"report": {
        "input": {"path": "/abs/in/report.pdf", "name": "report.pdf", "size": 53114,
                  "mtime_ns": 1765140000000000000, "sha256": "..."},
        "options": {"backend": {"checkpoint": "/abs/model", "dtype": null}, "crop": "auto", ...},
        "status": "complete",          # complete | partial (some page failed: done again) | failed
        "error": null,                 # a failed document's reason
        "outputs": {"report.md": "<sha256>", "report/page-0001.md": "<sha256>", ...},
        "pages": [{"page": 1, "source": "report.pdf page 1", "finish_reason": "stop",
                   "tokens": 412, "seconds": 3.1}, ...]}}}

A document is skipped when its entry is ``complete``, its input has the same name, size and
sha256, the options that change the text (:func:`output_options`) are the same, and every output
it names is there with its digest. Nothing else is trusted: a manifest that cannot be read is
started afresh (every document done again).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..fileio import atomic_write

__all__ = ["MANIFEST", "MANIFEST_VERSION", "Workspace", "input_info", "sha256_file", "sha256_text"]

#: The manifest's name in ``--out`` (no document's outputs take it).
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
#: A document's status in the manifest: written, every page read (``length`` and ``refused``
#: pages included: the same options give them again).
COMPLETE = "complete"
#: Written, but some page could not be rendered (finish reason ``error``): done again next run.
PARTIAL = "partial"
#: Not written (its ``error``): done again next run.
FAILED = "failed"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def input_info(path: str) -> dict[str, Any]:
    """An input file's identity: its absolute path, name, size, modification time and sha256."""
    st = os.stat(path)
    return {
        "path": os.path.abspath(path),
        "name": os.path.basename(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": sha256_file(path),
    }


def _same_input(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The same file for the outputs: its name (in each page's source), size and content."""
    return all(old.get(k) == new.get(k) for k in ("name", "size", "sha256"))


class Workspace:
    """The manifest of an ``--out`` folder: :meth:`load`, :meth:`reusable`, :meth:`record` (which
    writes it whole)."""

    def __init__(self, out: str, documents: dict[str, Any] | None = None, note: str | None = None):
        self.out = out
        self.documents: dict[str, Any] = documents or {}
        #: why an existing manifest was not used (it could not be read), for the user
        self.note = note

    @property
    def path(self) -> str:
        return os.path.join(self.out, MANIFEST)

    @classmethod
    def load(cls, out: str) -> Workspace:
        path = os.path.join(out, MANIFEST)
        if not os.path.lexists(path):
            return cls(out)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
                raise ValueError(f"not a version {MANIFEST_VERSION} manifest")
            docs = data.get("documents")
            if not isinstance(docs, dict) or not all(isinstance(v, dict) for v in docs.values()):
                raise ValueError("no documents")
        except (OSError, ValueError) as exc:
            return cls(out, note=f"{path} could not be read ({exc}): every document is done again")
        return cls(out, docs)

    def save(self) -> None:
        data = {"version": MANIFEST_VERSION, "documents": dict(sorted(self.documents.items()))}
        text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)

        atomic_write(self.path, write)

    def reusable(self, name: str, info: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
        """Output ``name``'s entry when it can be used as it is (module docstring), else None."""
        entry = self.documents.get(name)
        if not entry or entry.get("status") != COMPLETE or entry.get("options") != options:
            return None
        if not isinstance(entry.get("input"), dict) or not _same_input(entry["input"], info):
            return None
        outputs = entry.get("outputs")
        if not isinstance(outputs, dict) or not outputs or not isinstance(entry.get("pages"), list):
            return None
        for rel, digest in outputs.items():
            path = os.path.join(self.out, rel)
            if os.path.islink(path) or os.path.islink(os.path.dirname(path)) or not os.path.isfile(path):
                return None
            try:
                if sha256_file(path) != digest:
                    return None
            except OSError:
                return None
        return entry

    def record(
        self,
        name: str,
        info: dict[str, Any],
        options: dict[str, Any],
        *,
        pages: list[dict[str, Any]] | None = None,
        outputs: dict[str, str] | None = None,
        error: str | None = None,
    ) -> None:
        """Output ``name``'s entry after its files are written (``pages``, ``outputs``) or it
        failed (``error``); the manifest is written whole."""
        if error is not None:
            status = FAILED
        elif any(p.get("finish_reason") == "error" for p in pages or []):
            status = PARTIAL
        else:
            status = COMPLETE
        keep = ("page", "source", "finish_reason", "tokens", "seconds", "error")
        self.documents[name] = {
            "input": info,
            "options": options,
            "status": status,
            "error": error,
            "outputs": dict(outputs or {}),
            "pages": [{k: p[k] for k in keep if p.get(k) is not None} for p in pages or []],
        }
        self.save()
