//! The cost of `ComponentsManager::run` for a component that is already resident: what every denoising step
//! pays once the transformer is on the device. Goal (issue 20): under 100 ns for `run/resident`.
//!
//! - `run/resident`: one component run again and again, the timeline disabled (the default): a denoising loop.
//! - `run/resident_alternating`: two resident components run in turn, so the schedule of uses changes
//!   component at every run (its worst case).
//! - `run/resident_traced`: `run/resident` with a recording timeline, so each run appends its `run` span.
//!
//! The last two run in chunks of [`CHUNK`] runs, each on a fresh session (auto offload enabled again, a fresh
//! timeline), set up outside the timed part: the schedule and the timeline of millions of runs would otherwise
//! grow without bound while criterion iterates (the timeline would stop at its cap and time only the drop).

#![allow(missing_docs)] // criterion's macros generate undocumented functions.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use offload_core::{ComponentError, ComponentsManager, DeviceMemory, DeviceName, Offloadable, Timeline};

/// Runs per fresh session in the chunked benches.
const CHUNK: u64 = 1 << 16;

struct Card;

impl DeviceMemory for Card {
    fn device(&self) -> DeviceName {
        DeviceName::parse("cuda:0").expect("a valid device name")
    }
    fn total(&self) -> u64 {
        80 << 30
    }
    fn available(&self) -> u64 {
        40 << 30
    }
    fn allocated(&self) -> u64 {
        40 << 30
    }
    fn peak(&self) -> u64 {
        40 << 30
    }
}

struct Model {
    device: DeviceName,
    value: u64,
}

impl Offloadable for Model {
    fn bytes(&self) -> u64 {
        1 << 30
    }
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        self.device = device.clone();
        Ok(())
    }
    fn offload(&mut self) -> Result<(), ComponentError> {
        self.device = DeviceName::cpu();
        Ok(())
    }
}

/// A manager with a text encoder, a transformer and a VAE, all three resident, and their ids.
fn resident_pipeline() -> (ComponentsManager, Vec<String>) {
    let manager = ComponentsManager::new();
    let mut ids = Vec::new();
    for name in ["text_encoder", "transformer", "vae"] {
        ids.push(manager.add(name, Model { device: DeviceName::cpu(), value: 1 }, None).expect("a valid name"));
    }
    onload_all(&manager, &ids);
    (manager, ids)
}

/// A fresh session: auto offload enabled again (which clears the schedule), every component onloaded.
fn onload_all(manager: &ComponentsManager, ids: &[String]) {
    manager.enable_auto_offload(Arc::new(Card), 3_000_000_000, true).expect("enable");
    for id in ids {
        manager.run(id, |m: &mut Model| Ok(m.value)).expect("onload");
    }
}

fn run_once(manager: &ComponentsManager, id: &str) -> u64 {
    manager.run(id, |m: &mut Model| Ok(black_box(m.value))).expect("run")
}

/// Times `iters` calls of `step` (given the call's number), in chunks of [`CHUNK`] with `reset` before each,
/// untimed.
fn chunked(iters: u64, mut reset: impl FnMut(), mut step: impl FnMut(u64)) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        reset();
        let n = CHUNK.min(iters - done);
        let start = Instant::now();
        for i in done..done + n {
            step(i);
        }
        total += start.elapsed();
        done += n;
    }
    total
}

fn resident_run(c: &mut Criterion) {
    let (manager, ids) = resident_pipeline();
    let transformer = ids[1].clone();
    c.bench_function("run/resident", |b| b.iter(|| run_once(&manager, &transformer)));

    let (manager, ids) = resident_pipeline();
    let pair = [ids[1].clone(), ids[2].clone()];
    c.bench_function("run/resident_alternating", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                || onload_all(&manager, &ids),
                |i| {
                    run_once(&manager, &pair[(i % 2) as usize]);
                },
            )
        })
    });

    let (manager, ids) = resident_pipeline();
    let transformer = ids[1].clone();
    c.bench_function("run/resident_traced", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                || manager.set_timeline(Timeline::enabled()),
                |_| {
                    run_once(&manager, &transformer);
                },
            )
        })
    });
}

criterion_group!(benches, resident_run);
criterion_main!(benches);
