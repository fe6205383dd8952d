"""Output directories the generators own, so that a generator never destroys what it did not make.

A generator writes into a directory that is missing, empty, or that it made before (it left its manifest,
`.offload-generated.json`, listing every file it wrote). A non-empty directory without that manifest is refused
unless `--force` is given, and even then nothing in it is removed: the files it holds are left, and only the
files the generator writes are listed as its own. Before it writes again into a directory it made, a generator
removes the files its manifest lists, and nothing else (then the directories that became empty).

`python3 tools/owned_output.py --self-test` checks the rules in a temporary directory (CI runs it: no torch
needed).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

MANIFEST = ".offload-generated.json"


class Refused(SystemExit):
    """The directory holds files the generator did not make, and `--force` was not given."""


class OwnedOutput:
    """An output directory `root` written by `tool`."""

    def __init__(self, root: Path, tool: str, force: bool = False, tag: str | None = None) -> None:
        self.root = root
        self.tool = tool
        self.force = force
        # Generators that share a directory (the goldens) keep one manifest each, `.offload-generated-TAG.json`.
        self.manifest_name = MANIFEST if tag is None else f".offload-generated-{tag}.json"
        self.before: set[Path] = set()

    def files(self) -> set[Path]:
        if not self.root.exists():
            return set()
        return {p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file() or p.is_symlink()}

    def made_by_a_generator(self) -> bool:
        return self.root.is_dir() and any(self.root.glob(".offload-generated*.json"))

    def own(self) -> list[Path]:
        manifest = self.root / self.manifest_name
        if not manifest.is_file():
            return []
        listed = json.loads(manifest.read_text()).get("files", [])
        # Only paths inside the directory are ever removed, whatever the manifest says.
        own = []
        for name in listed:
            path = Path(name)
            if path.is_absolute() or ".." in path.parts:
                continue
            own.append(path)
        return own

    def prepare(self) -> None:
        """Refuses a foreign non-empty directory without --force; removes the generator's own earlier files."""
        if self.root.exists() and not self.root.is_dir():
            raise Refused(f"{self.tool}: {self.root} is a file, not a directory; give a directory to write into")
        present = self.files()
        manifest = self.root / self.manifest_name
        if present and not self.made_by_a_generator() and not self.force:
            raise Refused(
                f"{self.tool}: {self.root} is not empty ({len(present)} files) and was not made by this tool "
                f"(no {MANIFEST}); nothing was changed. Pick an empty or new directory, or pass --force to write "
                "into it anyway (its files are kept; only the files written now become the tool's own)"
            )
        for path in self.own():
            target = self.root / path
            if target.is_file() or target.is_symlink():
                target.unlink()
        # Directories the removal emptied go too, deepest first; a directory holding anything else stays.
        if self.root.exists():
            for directory in sorted((p for p in self.root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                if not any(directory.iterdir()):
                    directory.rmdir()
        if manifest.is_file():
            manifest.unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        self.before = self.files()

    def finish(self) -> None:
        """Lists every file written since `prepare` as the generator's own."""
        written = sorted(str(p) for p in self.files() - self.before if not p.name.startswith(".offload-generated"))
        (self.root / self.manifest_name).write_text(json.dumps({"tool": self.tool, "files": written}, indent=2) + "\n")


def self_test() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "out"
        # A new directory is made, written, and listed.
        owned = OwnedOutput(root, "test")
        owned.prepare()
        (root / "a").mkdir()
        (root / "a" / "one.bin").write_text("1")
        owned.finish()
        assert json.loads((root / MANIFEST).read_text())["files"] == [os.path.join("a", "one.bin")]
        # A file someone else put there survives a rewrite; the tool's own file is replaced.
        (root / "a" / "theirs.txt").write_text("keep")
        owned = OwnedOutput(root, "test")
        owned.prepare()
        assert not (root / "a" / "one.bin").exists() and (root / "a" / "theirs.txt").read_text() == "keep"
        (root / "a" / "one.bin").write_text("2")
        owned.finish()
        # A foreign non-empty directory is refused without --force, and nothing in it changes.
        foreign = Path(tmp) / "foreign"
        foreign.mkdir()
        (foreign / "precious.txt").write_text("mine")
        try:
            OwnedOutput(foreign, "test").prepare()
        except Refused as refused:
            assert "not empty" in str(refused) and "--force" in str(refused)
        else:
            raise AssertionError("a foreign directory was accepted")
        assert (foreign / "precious.txt").read_text() == "mine"
        # With --force the foreign files are kept and never listed as the tool's.
        owned = OwnedOutput(foreign, "test", force=True)
        owned.prepare()
        (foreign / "new.bin").write_text("x")
        owned.finish()
        assert json.loads((foreign / MANIFEST).read_text())["files"] == ["new.bin"]
        OwnedOutput(foreign, "test").prepare()
        assert (foreign / "precious.txt").read_text() == "mine" and not (foreign / "new.bin").exists()
        # A manifest that names paths outside the directory removes nothing there.
        outside = Path(tmp) / "outside.txt"
        outside.write_text("safe")
        (foreign / MANIFEST).write_text(json.dumps({"files": ["../outside.txt", str(outside)]}))
        OwnedOutput(foreign, "test").prepare()
        assert outside.read_text() == "safe"
        # Two generators sharing a directory each remove only their own files.
        shared = Path(tmp) / "shared"
        first = OwnedOutput(shared, "first", tag="first")
        first.prepare()
        (shared / "a.bin").write_text("a")
        first.finish()
        second = OwnedOutput(shared, "second", tag="second")
        second.prepare()
        (shared / "b.bin").write_text("b")
        second.finish()
        OwnedOutput(shared, "first", tag="first").prepare()
        assert not (shared / "a.bin").exists() and (shared / "b.bin").read_text() == "b"
    print("owned_output: self-test passed")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    else:
        sys.exit(__doc__)
