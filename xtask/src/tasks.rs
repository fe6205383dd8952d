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
            command.args(["run", "--release", "--quiet", "-p", "group-offload", "--example", "overlap", "--"]).args(&args.rest);
            status(command, "the overlap benchmark")
        }
        other => bail!("unknown benchmark {other:?}; the benchmarks are: overlap"),
    }
}

/// Regenerates the fixtures with the reference implementation.
pub fn fixtures(args: &FixturesArgs) -> anyhow::Result<()> {
    let mut command = Command::new(&args.python);
    command.args(["tools/make_fixtures.py", "--out", "crates/pipeline-zimage/tests/fixtures"]);
    status(command, "tools/make_fixtures.py (install tools/requirements-fixtures.txt first)")
}
