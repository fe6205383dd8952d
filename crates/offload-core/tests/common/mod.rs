//! Test doubles for the manager: a card whose readings a test sets, and a dummy model that allocates on it.

#![allow(dead_code)] // Each test file uses a different part of the doubles.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use offload_core::{ComponentError, DeviceMemory, DeviceName};
use parking_lot::Mutex;

/// The anchor's test unit: 1 KiB.
pub const UNIT: u64 = 1024;

/// A card whose `available` is patched by the test (the anchor's `_patch_memory_stats`), or derived from a
/// capacity when the test wants allocations to fail (hard mode).
pub struct FakeCard {
    device: DeviceName,
    patched_available: Mutex<Option<u64>>,
    capacity: u64,
    allocated: AtomicU64,
    peak: AtomicU64,
}

impl FakeCard {
    /// A card of `capacity` bytes whose readings follow its allocations.
    pub fn hard(capacity: u64) -> Arc<Self> {
        Arc::new(Self {
            device: DeviceName::parse("cuda").unwrap(),
            patched_available: Mutex::new(None),
            capacity,
            allocated: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// A card that reports `available` whatever is allocated.
    pub fn patched(available: u64) -> Arc<Self> {
        let card = Self::hard(80 * UNIT);
        *card.patched_available.lock() = Some(available);
        card
    }

    /// Changes the patched reading.
    pub fn set_available(&self, available: u64) {
        *self.patched_available.lock() = Some(available);
    }

    /// Allocates `bytes`, failing with out-of-memory past the capacity (only when not patched).
    pub fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        let mut current = self.allocated.load(Ordering::SeqCst);
        loop {
            let next = current + bytes;
            if self.patched_available.lock().is_none() && next > self.capacity {
                return Err(ComponentError::OutOfMemory {
                    device: self.device.clone(),
                    requested: bytes,
                    available: self.capacity - current,
                });
            }
            match self.allocated.compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::SeqCst);
                    return Ok(());
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Frees `bytes`.
    pub fn free(&self, bytes: u64) {
        self.allocated.fetch_sub(bytes, Ordering::SeqCst);
    }
}

impl DeviceMemory for FakeCard {
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn total(&self) -> u64 {
        self.capacity
    }
    fn available(&self) -> u64 {
        self.patched_available.lock().unwrap_or_else(|| self.capacity - self.allocated.load(Ordering::SeqCst))
    }
    fn allocated(&self) -> u64 {
        self.allocated.load(Ordering::SeqCst)
    }
    fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }
}

/// The anchor's `DummyModel`: one weight of `bytes`, forward `x + sum(weight)`; its output takes `output` bytes
/// on the card while the run lasts, and `decode` is a second entry point.
pub struct Dummy {
    pub bytes: u64,
    pub weight_sum: f64,
    pub device: DeviceName,
    pub card: Arc<FakeCard>,
    pub onloads: u64,
}

impl Dummy {
    /// A dummy of `bytes` on the host.
    pub fn new(bytes: u64, card: &Arc<FakeCard>) -> Self {
        Self { bytes, weight_sum: bytes as f64 / 7.0, device: DeviceName::cpu(), card: card.clone(), onloads: 0 }
    }

    /// `x + sum(weight)`, holding `output` bytes on the card for the call.
    pub fn forward(&self, x: f64, output: u64) -> Result<f64, ComponentError> {
        assert!(!self.device.is_cpu(), "the manager runs components on the execution device");
        self.card.allocate(output)?;
        self.card.free(output);
        Ok(x + self.weight_sum)
    }

    /// A second entry point, like a VAE's decode.
    pub fn decode(&self, x: f64, output: u64) -> Result<f64, ComponentError> {
        self.forward(x * 2.0, output)
    }
}

impl offload_core::Offloadable for Dummy {
    fn bytes(&self) -> u64 {
        self.bytes
    }
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        self.card.allocate(self.bytes)?;
        self.device = device.clone();
        self.onloads += 1;
        Ok(())
    }
    fn offload(&mut self) -> Result<(), ComponentError> {
        self.card.free(self.bytes);
        self.device = DeviceName::cpu();
        Ok(())
    }
}
