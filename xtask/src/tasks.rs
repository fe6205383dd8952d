//! Commands that run other programs: benchmarks that need burn, and the Python fixture generator.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// Arguments of `cargo xtask bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Which benchmark: `overlap`.
    pub name: String,
    /// Extra arguments passed to the benchmark program.
    #[arg(trailing_var_arg = true)]
    pub rest: Vec<String>,
}

/// Arguments of `cargo xtask fixtures`.
#[derive(clap::Args)]
pub struct FixturesArgs {
    /// The Python interpreter with diffusers 0.42.1, transformers and torch installed.
    #[arg(long, default_value = "python3")]
    pub python: String,
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

fn status(mut command: Command, what: &str) -> anyhow::Result<()> {
    let status = command.current_dir(workspace_root()).status().with_context(|| format!("cannot start {what}"))?;
    if !status.success() {
        bail!("{what} failed with {status}");
    }
    Ok(())
}

/// Runs a benchmark program.
pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    match args.name.as_str() {
        "overlap" => {
            let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            command.args(["run", "--quiet", "-p", "group-offload", "--example", "overlap", "--"]).args(&args.rest);
            status(command, "the overlap benchmark")
        }
        other => bail!("unknown benchmark {other:?}; the benchmarks are: overlap"),
    }
}

/// Regenerates the fixtures with the reference implementation.
pub fn fixtures(args: &FixturesArgs) -> anyhow::Result<()> {
    let mut command = Command::new(&args.python);
    command.args(["tools/make_fixtures.py", "--out", "crates/pipeline-zimage/tests/fixtures"]);
    status(command, "tools/make_fixtures.py (install tools/requirements-fixtures.txt first)")?;
    // The variants are overlays on the tiny checkpoint just written.
    let mut command = Command::new(&args.python);
    command.args(["tools/make_variant_fixtures.py", "--fixtures", "crates/pipeline-zimage/tests/fixtures"]);
    status(command, "tools/make_variant_fixtures.py (install tools/requirements-fixtures.txt first)")
}

/// The LLVM release burn 0.22.1's CUDA backend builds against (cubecl-cuda 0.11 → tracel-llvm-bundler).
const TRACEL_LLVM: &str = "tracel-llvm-23.1.0-4";
/// The static LLVM 23.1 with `llvm-config` and the NVPTX target, from the Python registry.
const LLVM_WHEELS: &[&str] = &["mlc-llvm-static==23.1.1.post0", "mlc-llvm-static-extra-targets==23.1.1.post0"];

/// Arguments of `cargo xtask setup-cuda`.
#[derive(clap::Args)]
pub struct SetupCudaArgs {
    /// The Python interpreter whose pip downloads the wheels (it also runs `llvm-config`, a Python script).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Install here instead of the platform's local data directory (for tests).
    #[arg(long)]
    pub into: Option<PathBuf>,
}

/// Installs the LLVM bundle that burn's `cuda` feature needs, without the bundler's download.
///
/// burn 0.22.1's `cuda` feature builds cubecl-cuda 0.11, whose `tracel-llvm-bundler` build script downloads an
/// LLVM 23 archive unless `<local data dir>/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed` exists. This
/// command downloads the static LLVM 23.1 SDK from the Python registry instead (two wheels: the base SDK and
/// the extra targets with NVPTX), merges their `static/` trees into that directory and writes the sentinel.
pub fn setup_cuda(args: &SetupCudaArgs) -> anyhow::Result<()> {
    let target = match &args.into {
        Some(dir) => dir.clone(),
        None => dirs::data_local_dir()
            .context("this platform has no local data directory; pass --into DIR")?
            .join("tracel")
            .join(TRACEL_LLVM),
    };
    let sentinel = target.join(".tracel-llvm-installed");
    if sentinel.exists() {
        println!("LLVM for burn's cuda feature is already installed in {}", target.display());
        return Ok(());
    }
    let scratch = std::env::temp_dir().join(format!("xtask-setup-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let mut download = Command::new(&args.python);
    download.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d"]).arg(&scratch).args(LLVM_WHEELS);
    status(download, "pip download of the LLVM wheels")?;
    let unpacked = scratch.join("unpacked");
    for entry in std::fs::read_dir(&scratch)? {
        let wheel = entry?.path();
        if wheel.extension().is_some_and(|e| e == "whl") {
            let mut unzip = Command::new(&args.python);
            unzip.args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&unpacked);
            status(unzip, "unpacking a wheel")?;
        }
    }
    let sdk = unpacked.join("mlc_llvm_static").join("static");
    if !sdk.join("bin").join("llvm-config").exists() {
        bail!(
            "the wheels did not contain mlc_llvm_static/static/bin/llvm-config; check the pinned versions {LLVM_WHEELS:?}"
        );
    }
    copy_tree(&sdk, &target)?;
    make_executable(&target.join("bin"))?;
    std::fs::write(&sentinel, "installed by cargo xtask setup-cuda from mlc-llvm-static 23.1.1.post0\n")?;
    std::fs::remove_dir_all(&scratch).ok();
    println!("installed LLVM 23.1 for burn's cuda feature in {}", target.display());
    println!("now: cargo build -p pipeline-zimage --features cuda");
    Ok(())
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let destination = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &destination)?;
        } else {
            std::fs::copy(entry.path(), &destination)
                .with_context(|| format!("copying to {}", destination.display()))?;
        }
    }
    Ok(())
}

fn make_executable(bin: &std::path::Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    for entry in std::fs::read_dir(bin)? {
        use std::os::unix::fs::PermissionsExt;
        let path = entry?.path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}
