//! `cargo xtask fuzz`: the parsers that take user input, each run on at least a million mutated inputs.
//!
//! The size, settings and card parsers run in this process. The checkpoint readers (`model_index.json`, the
//! shard index, the component configs, safetensors files) need burn, which xtask does not build, so they run
//! afterwards as a child process: `pipeline-zimage`'s `fuzz_readers` example, in release mode with overflow
//! checks on for that crate, so an overflowing size is a crash rather than a silently wrong number.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};
use tests::fuzz::{FuzzReport, corpus, fuzz};

/// Arguments of `cargo xtask fuzz`.
#[derive(clap::Args)]
pub struct Args {
    /// Inputs per target.
    #[arg(long, default_value_t = 1_000_000)]
    pub executions: u64,
    /// The generator's seed, for reproducing a run.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Only this target: an in-process one (size, card, settings), a checkpoint reader (model_index,
    /// shard_index, transformer_config, text_encoder_config, vae_config, scheduler_config, safetensors), the
    /// library's generation options (options), a LoRA file (lora_file), vulkaninfo's report (vulkaninfo) or the
    /// CLI's numeric arguments (cli); default: all.
    #[arg(long)]
    pub target: Option<String>,
}

fn corpus_of(target: &str) -> Vec<Vec<u8>> {
    corpus(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("fuzz").join("corpus").join(target))
}

/// A fuzz target: a name and a function that must return for any bytes (an error is fine), never panic.
pub type Target = (&'static str, fn(&[u8]));

/// The in-process targets.
pub fn targets() -> Vec<Target> {
    vec![
        ("size", |input| {
            if let Ok(text) = std::str::from_utf8(input)
                && let Ok(bytes) = offload_core::parse_size(text)
            {
                // A parsed size formats without panicking, whatever its magnitude.
                let _ = offload_core::format_size(bytes);
            }
        }),
        ("settings", |input| {
            let Ok(text) = std::str::from_utf8(input) else { return };
            // The same bytes as a TOML file, as environment lines, and as `key=value` arguments.
            let _ = offload_core::plan::SettingsLayer::from_toml(text);
            let vars = text.lines().filter_map(|line| line.split_once('='));
            let _ = offload_core::plan::SettingsLayer::from_env(vars);
            let mut layer = offload_core::plan::SettingsLayer::default();
            for (key, value) in text.lines().filter_map(|line| line.split_once('=')) {
                let _ = layer.set(key.trim(), value.trim());
            }
        }),
        ("card", |input| {
            if let Ok(text) = std::str::from_utf8(input)
                && let Ok(card) = memory_sim::CardSpec::parse(text)
            {
                let _ = card.check_reserve(3_000_000_000);
            }
        }),
    ]
}

/// The checkpoint readers' targets, as `pipeline-zimage/examples/fuzz_readers/targets.rs` names them (kept in
/// step by hand: xtask cannot link that crate).
pub const READERS: &[&str] = &[
    "model_index",
    "shard_index",
    "transformer_config",
    "text_encoder_config",
    "vae_config",
    "scheduler_config",
    "safetensors",
    "options",
    "lora_file",
    "vulkaninfo",
];

/// The CLI's target: `pipeline-zimage generate`'s argument parsing and pre-flight checks (seeds, sides, sizes), run
/// by the binary's own ignored test, since xtask cannot link the binary either.
pub const CLI: &str = "cli";

/// Runs `cargo xtask fuzz`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let in_process = targets();
    let only_in_process = args.target.as_deref().is_some_and(|t| in_process.iter().any(|(name, _)| *name == t));
    if let Some(target) = args.target.as_deref().filter(|t| !only_in_process && !READERS.contains(t) && *t != CLI) {
        let names: Vec<&str> =
            in_process.iter().map(|(name, _)| *name).chain(READERS.iter().copied()).chain([CLI]).collect();
        bail!("no fuzz target named {target:?}; the targets are: {}", names.join(", "));
    }
    let mut reports: Vec<FuzzReport> = Vec::new();
    for (name, target) in in_process {
        if args.target.as_deref().is_some_and(|t| t != name) {
            continue;
        }
        let report = fuzz(name, &corpus_of(name), args.executions, args.seed, target);
        println!("{report}");
        reports.push(report);
    }
    let crashes: Vec<&FuzzReport> = reports.iter().filter(|r| !r.crashes.is_empty()).collect();
    for report in &crashes {
        for input in &report.crashes {
            println!("crash in {}: {:?}", report.target, String::from_utf8_lossy(input));
        }
    }
    if !crashes.is_empty() {
        bail!("{} target(s) crashed; add each input above as a regression test", crashes.len());
    }
    if !only_in_process && args.target.as_deref() != Some(CLI) {
        readers(args)?;
    }
    if args.target.as_deref().is_none_or(|t| t == CLI) {
        cli(args)?;
    }
    Ok(())
}

/// Runs the CLI's target: the `pipeline-zimage` binary's ignored fuzz test, in release mode with overflow checks
/// on, so an overflowing seed or size is a crash.
fn cli(args: &Args) -> anyhow::Result<()> {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["test", "--release", "-q", "-p", "pipeline-zimage", "--bin", "pipeline-zimage"])
        .args(["--config", "profile.release.package.pipeline-zimage.overflow-checks=true", "--"])
        .args(["--ignored", "--exact", "tests::fuzz_the_clis_numeric_arguments", "--nocapture"])
        .env("CLI_FUZZ_EXECUTIONS", args.executions.to_string())
        .env("CLI_FUZZ_SEED", args.seed.to_string());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = command.current_dir(root).status().context("cannot start cargo for the CLI's fuzz target")?;
    if !status.success() {
        bail!("the CLI's fuzz run failed with {status}");
    }
    Ok(())
}

/// Runs the checkpoint readers' targets in `pipeline-zimage`'s `fuzz_readers` example.
fn readers(args: &Args) -> anyhow::Result<()> {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["run", "--release", "-q", "-p", "pipeline-zimage", "--example", "fuzz_readers"])
        .args(["--config", "profile.release.package.pipeline-zimage.overflow-checks=true", "--"])
        .args(["--executions", &args.executions.to_string(), "--seed", &args.seed.to_string()]);
    if let Some(target) = &args.target {
        command.args(["--target", target]);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let status =
        command.current_dir(root).status().context("cannot start cargo for the checkpoint readers' fuzz targets")?;
    if !status.success() {
        bail!("the checkpoint readers' fuzz run failed with {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests_smoke {
    /// The harness and every target, briefly, so CI keeps them working.
    #[test]
    fn every_target_survives_a_short_run() {
        for (name, target) in super::targets() {
            let report = tests::fuzz::fuzz(name, &super::corpus_of(name), 20_000, 3, target);
            assert!(report.crashes.is_empty(), "{name}: {:?}", report.crashes);
        }
    }
}
