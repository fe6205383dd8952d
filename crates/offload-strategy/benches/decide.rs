//! How long one `decide` takes for 5 to 40 resident components, for each built-in strategy.
//!
//! Sizes are pseudo-random (a fixed linear congruential sequence) between 64 MiB and about 2 GiB, and the incoming
//! component is 40% of the resident total on a full device, so `Auto` has a real search to do.

// `criterion_group!` defines a public function that cannot carry a doc comment.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use offload_strategy::{
    Auto, ComponentView, KeepTogether, Lookahead, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent,
    Sequential,
};

const COUNTS: [usize; 4] = [5, 10, 20, 40];

/// `n` residents with fixed pseudo-random sizes, and an incoming component needing 40% of their total.
fn scenario(n: usize) -> (ComponentView, Vec<ResidentComponent>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
    let resident: Vec<ResidentComponent> = (0..n)
        .map(|i| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let bytes = (64 << 20) + (state >> 33);
            ResidentComponent::new(format!("c{i}"), format!("n{i}"), bytes)
        })
        .collect();
    let total: u64 = resident.iter().map(ResidentComponent::bytes).sum();
    (ComponentView::new("incoming", "incoming", total / 5 * 2), resident)
}

fn view<'a>(incoming: &'a ComponentView, resident: &'a [ResidentComponent]) -> OffloadView<'a> {
    OffloadView {
        incoming,
        resident,
        reading: MemoryReading { available: 0, total: 1 << 40, peak: 0 },
        reserve: 0,
        device: "cuda:0",
        use_index: 7,
    }
}

fn bench_strategy(c: &mut Criterion, group: &str, make: impl Fn(&[ResidentComponent]) -> Box<dyn OffloadStrategy>) {
    let mut group = c.benchmark_group(group);
    for n in COUNTS {
        let (incoming, resident) = scenario(n);
        let strategy = make(&resident);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(strategy.decide(black_box(&view(&incoming, &resident)))));
        });
    }
    group.finish();
}

fn decide(c: &mut Criterion) {
    bench_strategy(c, "auto", |_| Box::new(Auto));
    bench_strategy(c, "keep_together", |_| Box::new(KeepTogether::new([["incoming", "n0"]])));
    bench_strategy(c, "lookahead", |resident| {
        // Every resident used again, in reverse registration order, twice over.
        let names = resident.iter().rev().chain(resident.iter().rev()).map(|r| r.component.name.clone());
        Box::new(Lookahead::new(std::iter::repeat_n("incoming".to_string(), 7).chain(names)))
    });
    bench_strategy(c, "sequential", |_| Box::new(Sequential));
}

criterion_group!(benches, decide);
criterion_main!(benches);
