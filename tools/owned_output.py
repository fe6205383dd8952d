"""Output directories the generators own, so that a generator never destroys what it did not make.

A generator writes into a directory that is missing, empty, or that it made before (it left its manifest,
`.offload-generated.json`, listing every file it wrote). A non-empty directory without that manifest is refused
unless `--force` is given. Even then a generator never overwrites or removes a file it did not write: it declares
up front the files and folders it writes (`prepare(writes=...)`), and a directory holding a file there that its
manifest does not list, such as a real checkpoint's shard or tokenizer, is refused with or without `--force`;
each file is claimed again just before it is written (`claim`). A generator that declares nothing writes only into
a directory it made or an empty one. Before it writes again into a directory it made, a generator removes the
files its manifest lists, and nothing else (then the directories that became empty).

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
        # Files present before `prepare` that no manifest of this tool lists: never written over.
        self.foreign: set[Path] = set()

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

    @staticmethod
    def _covered(path: Path, writes: list[str]) -> bool:
        """Whether `path` is one of `writes` or lies under one of its folders (entries ending in `/`)."""
        text = path.as_posix()
        return any(text == w or (w.endswith("/") and text.startswith(w)) for w in writes)

    def prepare(self, writes: list[str] | None = None) -> None:
        """Refuses a foreign non-empty directory without --force, and a directory holding a file this tool did not
        write where it would write (`writes`: relative paths, folders ending in `/`) even with --force; then removes
        the generator's own earlier files. Nothing is changed when it refuses."""
        if self.root.exists() and not self.root.is_dir():
            raise Refused(f"{self.tool}: {self.root} is a file, not a directory; give a directory to write into")
        present = self.files()
        manifest = self.root / self.manifest_name
        made = self.made_by_a_generator()
        if present and not made and not self.force:
            raise Refused(
                f"{self.tool}: {self.root} is not empty ({len(present)} files) and was not made by this tool "
                f"(no {MANIFEST}); nothing was changed. Pick an empty or new directory, or pass --force to write "
                "into it anyway (files already there are never written over or removed; a directory holding a file "
                "where this tool writes, such as a real checkpoint, is refused even then)"
            )
        own = set(self.own())
        self.foreign = {p for p in present if p not in own and not p.name.startswith(".offload-generated")}
        if self.foreign and writes is None and not made:
            raise Refused(
                f"{self.tool}: {self.root} holds {len(self.foreign)} files this tool did not write, and the tool does "
                "not say which files it writes, so it writes only into an empty directory or one it made; nothing "
                "was changed. Pick an empty or new directory"
            )
        clash = sorted(p.as_posix() for p in self.foreign if writes is not None and self._covered(p, writes))
        if clash:
            raise Refused(
                f"{self.tool}: {self.root} holds {len(clash)} files this tool did not write where it writes (first: "
                f"{clash[0]}); it may be a real checkpoint, and a generator never writes over a file it did not make, "
                "even with --force; nothing was changed. Pick an empty or new directory"
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

    def claim(self, relative: str | Path) -> Path:
        """The path of `relative` in the directory, to write now: refused when a file this tool did not write is
        there (a second line behind `prepare(writes=...)`, for names known only while writing)."""
        path = Path(relative)
        if path in self.foreign:
            raise Refused(
                f"{self.tool}: {self.root / path} exists and this tool did not write it; a generator never writes over "
                "a file it did not make. Pick an empty or new directory"
            )
        return self.root / path

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
        owned.prepare(writes=["new.bin"])
        owned.claim("new.bin").write_text("x")
        owned.finish()
        assert json.loads((foreign / MANIFEST).read_text())["files"] == ["new.bin"]
        OwnedOutput(foreign, "test").prepare()
        assert (foreign / "precious.txt").read_text() == "mine" and not (foreign / "new.bin").exists()
        # A foreign file where the tool writes is refused even with --force, and nothing changes; so is a claim.
        checkpoint = Path(tmp) / "checkpoint"
        (checkpoint / "transformer").mkdir(parents=True)
        (checkpoint / "transformer" / "shard-1.safetensors").write_text("real weights")
        (checkpoint / "model_index.json").write_text("{}")
        for writes in (["transformer/"], ["model_index.json"], ["vae/", "transformer/config.json", "transformer/"]):
            try:
                OwnedOutput(checkpoint, "test", force=True).prepare(writes=writes)
            except Refused as refused:
                assert "did not write where it writes" in str(refused) and "even with --force" in str(refused)
            else:
                raise AssertionError(f"a real checkpoint was written into ({writes})")
            assert (checkpoint / "transformer" / "shard-1.safetensors").read_text() == "real weights"
            assert not (checkpoint / MANIFEST).exists()
        # Elsewhere in it, --force may add files, but never claim one that was there.
        owned = OwnedOutput(checkpoint, "test", force=True)
        owned.prepare(writes=["extra/"])
        owned.claim("extra/new.bin").parent.mkdir()
        (checkpoint / "extra" / "new.bin").write_text("x")
        try:
            owned.claim("model_index.json")
        except Refused as refused:
            assert "did not write" in str(refused)
        else:
            raise AssertionError("a foreign file was claimed")
        owned.finish()
        assert json.loads((checkpoint / MANIFEST).read_text())["files"] == ["extra/new.bin"]
        # A tool that declares nothing is refused a foreign directory even with --force.
        try:
            OwnedOutput(Path(tmp) / "foreign2", "test", force=True).prepare()
            (Path(tmp) / "foreign2").mkdir(exist_ok=True)
            (Path(tmp) / "foreign2" / "theirs").write_text("t")
            OwnedOutput(Path(tmp) / "foreign2", "test", force=True).prepare()
        except Refused as refused:
            assert "does not say which files it writes" in str(refused)
        else:
            raise AssertionError("an undeclared tool wrote into a foreign directory")
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
    generator_refuses_a_real_checkpoint()
    print("owned_output: self-test passed")


def generator_refuses_a_real_checkpoint() -> None:
    """tools/make_real_size.py pointed at a downloaded checkpoint, with and without --force: refused before it
    imports torch, every file as it was."""
    import subprocess

    script = Path(__file__).resolve().parent / "make_real_size.py"
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "Z-Image-Turbo"
        files = {
            "model_index.json": '{"_class_name": "ZImagePipeline"}',
            "transformer/diffusion_pytorch_model-00001-of-00003.safetensors": "real weights",
            "tokenizer/tokenizer.json": "the real tokenizer",
        }
        for name, text in files.items():
            (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
            (checkpoint / name).write_text(text)
        for force in ([], ["--force"]):
            run = subprocess.run([sys.executable, str(script), "--out", str(checkpoint), *force],
                                 capture_output=True, text=True)
            assert run.returncode != 0, f"make_real_size.py {force} wrote into a real checkpoint"
            expected = "even with --force" if force else "not empty"
            assert expected in run.stderr + run.stdout, run.stderr + run.stdout
            for name, text in files.items():
                assert (checkpoint / name).read_text() == text, f"{name} changed ({force})"
            assert sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()) == \
                sorted(files), "a file was added"


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    else:
        sys.exit(__doc__)
