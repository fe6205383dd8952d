//! Criterion bench of prefetch overlap: one streamed forward with prefetch on and off, with a link whose
//! transfer time is about the compute time of a group (see `group_offload::bench`).

#![allow(missing_docs)] // criterion's macros generate undocumented functions.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use group_offload::{bench::OverlapConfig, bench::overlap_benchmark};

fn overlap(c: &mut Criterion) {
    let mut group = c.benchmark_group("overlap");
    group.sample_size(10).measurement_time(Duration::from_secs(5));
    // One call runs all four modes; criterion times the whole, the report carries the ratios.
    group.bench_function("prefetch_vs_serial", |b| {
        b.iter(|| {
            let report = overlap_benchmark(black_box(OverlapConfig { forwards: 1, ..OverlapConfig::default() }));
            black_box(report.map(|r| r.prefetch_efficiency).unwrap_or_default())
        })
    });
    group.finish();
    if let Ok(report) = overlap_benchmark(OverlapConfig::default()) {
        println!("overlap: {report}");
    }
}

criterion_group!(benches, overlap);
criterion_main!(benches);
