//! The files a run writes: every one checked before the expensive work starts, and each written atomically.
//!
//! A run can take minutes to hours at real size, so a name it cannot write must be refused before the weights
//! load, not after the image exists: [`check_outputs`] checks each output's format (from its extension), its
//! directory, that the directory takes a new file, that no two outputs name the same file and that no output
//! names one of the run's inputs. [`write_atomic`] then writes each file under a temporary name in the same
//! directory and renames it into place, so a failure at any point leaves an existing file as it was (image 0.25's
//! `save` creates the file before it looks for an encoder, which truncated an existing file on a bad extension).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// What an output file holds, and so the extension its name must end in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A PNG image (the only image format this build encodes).
    Png,
    /// A safetensors file.
    Safetensors,
    /// Any name: the content says what it is (a JSON trace may be called anything).
    Any,
}

impl Format {
    /// The extension a name must end in, if any.
    fn extension(self) -> Option<&'static str> {
        match self {
            Format::Png => Some("png"),
            Format::Safetensors => Some("safetensors"),
            Format::Any => None,
        }
    }

    /// What the file is written as, for messages.
    fn written_as(self) -> &'static str {
        match self {
            Format::Png => "a PNG image (this build encodes no other image format)",
            Format::Safetensors => "a safetensors file",
            Format::Any => "a file",
        }
    }
}

/// One file a run will write: the flag that named it (`--out`), its path and its format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The command-line flag or setting that named the file, for messages.
    pub flag: String,
    /// The path as given.
    pub path: PathBuf,
    /// What it holds.
    pub format: Format,
}

impl Output {
    /// An output named by `flag`.
    pub fn new(flag: impl Into<String>, path: impl Into<PathBuf>, format: Format) -> Self {
        Self { flag: flag.into(), path: path.into(), format }
    }
}

/// The directory a file path lives in (`.` for a bare name).
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// The path a file resolves to, for comparing two names of one file: its directory resolved (links, `..`), then
/// its name. `None` where the directory does not exist.
fn resolved(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let directory = directory_of(path).canonicalize().ok()?;
    let joined = directory.join(name);
    // An existing file that is itself a link resolves to its target, which is the file a write would replace for
    // an input (read through the link); for an output the rename replaces the link, but two links to one file
    // are still one file to the user.
    Some(joined.canonicalize().unwrap_or(joined))
}

/// Checks one output's name: a file name (not a directory), ending in its format's extension, in a directory that
/// exists. Whether the directory takes a new file is checked once per directory by [`check_outputs`].
fn check_name(output: &Output) -> Result<&Path> {
    let problem = |problem: String| Error::OutputPath { flag: output.flag.clone(), path: output.path.clone(), problem };
    let path = &output.path;
    if path.as_os_str().is_empty() {
        return Err(problem("the name is empty; give a file name".into()));
    }
    if path.is_dir() {
        let example = match output.format.extension() {
            Some(extension) => format!("out.{extension}"),
            None => "out".to_string(),
        };
        return Err(problem(format!(
            "it is a directory; give a file name in it, such as {}",
            path.join(example).display()
        )));
    }
    if path.file_name().is_none() {
        return Err(problem("it names no file (it ends in `..` or `/`); give a file name".into()));
    }
    if let Some(wanted) = output.format.extension()
        && !path.extension().is_some_and(|e| e.eq_ignore_ascii_case(wanted))
    {
        return Err(problem(format!(
            "the file is written as {}; give a name ending in .{wanted}",
            output.format.written_as()
        )));
    }
    let directory = directory_of(path);
    if !directory.is_dir() {
        return Err(problem(format!(
            "the directory {} does not exist; create it first or write elsewhere",
            directory.display()
        )));
    }
    Ok(directory)
}

/// Checks every output before anything runs: each one can be written (its name, its [`Format`], a directory that
/// exists and takes a new file), no two name the same file, and none names one of `inputs` (the files the run
/// reads, as `(flag, path)`), which it would replace. Nothing is created or changed (the probe file that shows a
/// directory takes a new file is removed again). The first problem is returned, naming the flags and the fix.
pub fn check_outputs(outputs: &[Output], inputs: &[(&str, &Path)]) -> Result<()> {
    let mut probed: HashSet<PathBuf> = HashSet::new();
    for output in outputs {
        let directory = check_name(output)?;
        if probed.insert(directory.to_path_buf()) {
            // Each file is written under a temporary name in its directory and renamed into place, so what must
            // work is creating a new file there (an existing file is never opened for writing).
            tempfile::Builder::new().prefix(".zimage-probe-").tempfile_in(directory).map_err(|e| {
                Error::OutputPath {
                    flag: output.flag.clone(),
                    path: output.path.clone(),
                    problem: format!(
                        "a new file cannot be created in {} ({e}); choose a writable directory",
                        directory.display()
                    ),
                }
            })?;
        }
    }
    let read: HashMap<PathBuf, &str> =
        inputs.iter().filter_map(|(flag, path)| Some((resolved(path)?, *flag))).collect();
    let mut written: HashMap<PathBuf, &Output> = HashMap::new();
    for output in outputs {
        let Some(path) = resolved(&output.path) else { continue };
        if let Some(input) = read.get(&path) {
            return Err(Error::OutputReplacesInput {
                output: output.flag.clone(),
                input: (*input).to_string(),
                path: output.path.clone(),
            });
        }
        if let Some(first) = written.insert(path, output) {
            return Err(Error::OutputsCollide {
                first: first.flag.clone(),
                second: output.flag.clone(),
                path: output.path.clone(),
            });
        }
    }
    Ok(())
}

/// Checks, before anything runs, that files can be written into the directory `dir` named by `flag` (capacity
/// profiles, link figures): it exists and takes a new file, or it does not exist yet and its nearest existing
/// ancestor is a directory that takes one (the writer creates it). Nothing is created or changed.
pub fn check_output_dir(flag: &str, dir: &Path) -> Result<()> {
    let problem = |problem: String| Error::OutputPath { flag: flag.to_string(), path: dir.to_path_buf(), problem };
    let mut existing = dir;
    while !existing.exists() {
        match existing.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => existing = parent,
            _ => {
                existing = Path::new(".");
                break;
            }
        }
    }
    if !existing.is_dir() {
        return Err(problem(format!("{} is a file, not a directory; give a directory", existing.display())));
    }
    tempfile::Builder::new().prefix(".zimage-probe-").tempfile_in(existing).map_err(|e| {
        problem(format!("a new file cannot be created in {} ({e}); choose a writable directory", existing.display()))
    })?;
    Ok(())
}

/// Writes `path` atomically: `write` fills a temporary file in the same directory, which is flushed, synced and
/// renamed over `path` only once `write` succeeded. On any failure the temporary file is removed and an existing
/// file at `path` is as it was. The new file gets the permissions a plain create would (0666 less the umask).
pub fn write_atomic(path: &Path, write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>) -> Result<()> {
    let failed = |source: std::io::Error| Error::OutputWrite { path: path.to_path_buf(), source };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".partial");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    // The path half removes the temporary file when dropped, so every early return below cleans up.
    let (file, temporary) = builder.tempfile_in(directory_of(path)).map_err(failed)?.into_parts();
    let mut writer = BufWriter::new(file);
    write(&mut writer).map_err(failed)?;
    let file = writer.into_inner().map_err(|e| failed(e.into_error()))?;
    file.sync_all().map_err(failed)?;
    drop(file);
    temporary.persist(path).map_err(|e| failed(e.error))?;
    Ok(())
}

/// Writes `bytes` to `path` atomically ([`write_atomic`]).
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, |file| file.write_all(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary directory")
    }

    #[test]
    fn a_failed_write_leaves_the_existing_file_as_it_was() {
        let dir = scratch();
        let path = dir.path().join("photo.png");
        std::fs::write(&path, b"precious").expect("write");
        let result = write_atomic(&path, |file| {
            file.write_all(b"half an ima")?;
            Err(std::io::Error::other("the encoder failed"))
        });
        assert!(matches!(result, Err(Error::OutputWrite { .. })), "{result:?}");
        assert_eq!(std::fs::read(&path).expect("read"), b"precious");
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("list").collect();
        assert_eq!(left.len(), 1, "the temporary file is removed: {left:?}");
    }

    #[test]
    fn a_write_replaces_the_file_whole_with_a_plain_files_permissions() {
        let dir = scratch();
        let path = dir.path().join("out.png");
        std::fs::write(&path, b"old").expect("write");
        write_bytes_atomic(&path, b"new bytes").expect("written");
        assert_eq!(std::fs::read(&path).expect("read"), b"new bytes");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).expect("metadata").permissions().mode() & 0o777;
            assert_ne!(mode & 0o044, 0, "readable by others as a plain create makes it (umask 022): {mode:o}");
        }
    }

    #[test]
    fn outputs_are_refused_by_format_directory_and_collision() {
        let dir = scratch();
        let at = |name: &str| dir.path().join(name);
        let png = |path: PathBuf| Output::new("--out", path, Format::Png);
        let expect = |outputs: &[Output], inputs: &[(&str, &Path)], wanted: &str| {
            let error = check_outputs(outputs, inputs).expect_err("refused").to_string();
            assert!(error.contains(wanted), "{error:?} lacks {wanted:?}");
        };
        expect(&[png(at("photo.jpg"))], &[], "give a name ending in .png");
        expect(&[png(at("photo"))], &[], "give a name ending in .png");
        expect(&[png(at("photo.webp"))], &[], "written as a PNG image");
        expect(&[png(at("missing/x.png"))], &[], "does not exist; create it first");
        expect(&[png(dir.path().to_path_buf())], &[], "is a directory");
        expect(
            &[png(at("same.png")), Output::new("--memory-plot", at("same.png"), Format::Png)],
            &[],
            "--out and --memory-plot both name",
        );
        // The same file named two ways.
        expect(
            &[png(at("same.png")), Output::new("--trace", dir.path().join(".").join("same.png"), Format::Any)],
            &[],
            "both name",
        );
        let input = at("input.png");
        std::fs::write(&input, b"an input").expect("write");
        expect(&[png(input.clone())], &[("--image", input.as_path())], "--out would replace --image");
        check_outputs(&[png(at("fine.png")), Output::new("--trace", at("run.json"), Format::Any)], &[])
            .expect("accepted");
        assert_eq!(std::fs::read_dir(dir.path()).expect("list").count(), 1, "the checks create nothing");
    }
}
