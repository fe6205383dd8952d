//! The cost of `ComponentsManager::run` for a component that is already resident: what every denoising step
//! pays once the transformer is on the device. Goal: under 1 µs.

#![allow(missing_docs)] // criterion's macros generate undocumented functions.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use offload_core::{ComponentError, ComponentsManager, DeviceMemory, DeviceName, Offloadable};

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

fn resident_run(c: &mut Criterion) {
    let manager = ComponentsManager::new();
    let mut ids = Vec::new();
    for name in ["text_encoder", "transformer", "vae"] {
        ids.push(manager.add(name, Model { device: DeviceName::cpu(), value: 1 }, None).expect("a valid name"));
    }
    manager.enable_auto_offload(Arc::new(Card), 3_000_000_000, true).expect("enable");
    for id in &ids {
        manager.run(id, |m: &mut Model| Ok(m.value)).expect("onload");
    }
    let transformer = ids[1].clone();
    c.bench_function("run/resident", |b| {
        b.iter(|| manager.run(&transformer, |m: &mut Model| Ok(std::hint::black_box(m.value))).expect("run"))
    });
}

criterion_group!(benches, resident_run);
criterion_main!(benches);
