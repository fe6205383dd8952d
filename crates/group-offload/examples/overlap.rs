//! `cargo xtask bench overlap`: group offload with prefetch on and off, side by side in one run, on the CPU
//! with a simulated link whose transfer time per group equals the measured compute time per group.
//!
//! Efficiency = max(compute only, transfer only) ÷ measured wall time: 1.0 means the transfers are hidden
//! entirely behind compute (or the reverse); serial streaming sits near 0.5 when the two are equal.
//! Arguments: `--forwards N` (default 9), `--groups N` (8), `--depth N` (2), `--runs N` (3, the median is kept).

use group_offload::{bench::OverlapConfig, bench::OverlapReport, bench::overlap_benchmark};

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), group_offload::Error> {
    let args: Vec<String> = std::env::args().collect();
    let config = OverlapConfig {
        forwards: arg(&args, "--forwards", 9),
        groups: arg(&args, "--groups", 8),
        prefetch_depth: arg(&args, "--depth", 2),
        ..OverlapConfig::default()
    };
    let runs = arg(&args, "--runs", 3).max(1);
    let mut reports: Vec<OverlapReport> = Vec::new();
    for run in 1..=runs {
        let report = overlap_benchmark(config.clone())?;
        println!("run {run}: {report}");
        reports.push(report);
    }
    reports.sort_by(|a, b| a.prefetch_efficiency.total_cmp(&b.prefetch_efficiency));
    let median = &reports[reports.len() / 2];
    println!(
        "{} groups of {}x{} weights, {} matmuls each, prefetch depth {}, median of {runs} runs of {} forwards",
        config.groups, config.dim, config.dim, config.matmuls_per_group, config.prefetch_depth, config.forwards
    );
    println!("overlap_efficiency prefetch={:.3} serial={:.3}", median.prefetch_efficiency, median.serial_efficiency);
    Ok(())
}
