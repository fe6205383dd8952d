//! `cargo xtask fuzz`: the parsers that take user input, each run on at least a million mutated inputs.

use std::path::PathBuf;

use anyhow::bail;
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
    /// Only this target (size, card, settings); default: all.
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

/// Runs `cargo xtask fuzz`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let mut reports: Vec<FuzzReport> = Vec::new();
    for (name, target) in targets() {
        if args.target.as_deref().is_some_and(|t| t != name) {
            continue;
        }
        let report = fuzz(name, &corpus_of(name), args.executions, args.seed, target);
        println!("{report}");
        reports.push(report);
    }
    if reports.is_empty() {
        bail!("no fuzz target named {:?}; the targets are: {}", args.target, targets().iter().map(|t| t.0).collect::<Vec<_>>().join(", "));
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
