//! Test doubles and a small model: a fake card that is both ledger and memory readings, and a six-block MLP.

#![allow(dead_code)] // Each test binary uses a different subset of these helpers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Distribution, Tensor};
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, Direction};
use parking_lot::Mutex;

/// A fake card: tracks allocated bytes and peak, can fail the nth allocation or transfer, and can sleep per
/// transfer to emulate a slow link.
#[derive(Debug, Default)]
pub struct FakeCard {
    pub capacity: u64,
    allocated: AtomicU64,
    peak: AtomicU64,
    allocations: AtomicUsize,
    transfers: AtomicUsize,
    /// Bytes copied from pinned host memory.
    pinned: AtomicU64,
    /// 1-based index of the allocation that fails (0 = none).
    pub fail_allocation: AtomicUsize,
    /// 1-based index of the transfer that fails (0 = none).
    pub fail_transfer: AtomicUsize,
    pub transfer_sleep: Mutex<Duration>,
    pub log: Mutex<Vec<String>>,
}

impl FakeCard {
    pub fn new(capacity: u64) -> Self {
        Self { capacity, ..Default::default() }
    }

    pub fn allocated(&self) -> u64 {
        self.allocated.load(Ordering::SeqCst)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    pub fn allocations(&self) -> usize {
        self.allocations.load(Ordering::SeqCst)
    }

    /// Bytes copied from pinned host memory so far.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.load(Ordering::SeqCst)
    }

    pub fn reset_peak(&self) {
        self.peak.store(self.allocated(), Ordering::SeqCst);
    }
}

impl DeviceLedger for FakeCard {
    fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        let n = self.allocations.fetch_add(1, Ordering::SeqCst) + 1;
        let available = self.capacity.saturating_sub(self.allocated());
        if n == self.fail_allocation.load(Ordering::SeqCst) || bytes > available {
            self.log.lock().push(format!("allocate {bytes} failed"));
            return Err(ComponentError::OutOfMemory {
                device: DeviceName::parse("cuda").unwrap(),
                requested: bytes,
                available,
            });
        }
        let now = self.allocated.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        self.log.lock().push(format!("allocate {bytes}"));
        Ok(())
    }

    fn free(&self, bytes: u64) {
        self.allocated.fetch_sub(bytes, Ordering::SeqCst);
        self.log.lock().push(format!("free {bytes}"));
    }

    fn transfer(&self, bytes: u64, _direction: Direction) -> Result<(), ComponentError> {
        let n = self.transfers.fetch_add(1, Ordering::SeqCst) + 1;
        let sleep = *self.transfer_sleep.lock();
        if !sleep.is_zero() {
            std::thread::sleep(sleep);
        }
        if n == self.fail_transfer.load(Ordering::SeqCst) {
            self.log.lock().push(format!("transfer {bytes} failed"));
            return Err(ComponentError::Transfer { what: format!("{bytes} bytes"), message: "link reset".into() });
        }
        self.log.lock().push(format!("transfer {bytes}"));
        Ok(())
    }

    fn transfer_pinned(&self, bytes: u64) -> Result<(), ComponentError> {
        self.transfer(bytes, Direction::HostToDevice)?;
        self.pinned.fetch_add(bytes, Ordering::SeqCst);
        Ok(())
    }
}

impl DeviceMemory for FakeCard {
    fn device(&self) -> DeviceName {
        DeviceName::parse("cuda").unwrap()
    }
    fn total(&self) -> u64 {
        self.capacity
    }
    fn available(&self) -> u64 {
        self.capacity.saturating_sub(self.allocated())
    }
    fn allocated(&self) -> u64 {
        FakeCard::allocated(self)
    }
    fn peak(&self) -> u64 {
        FakeCard::peak(self)
    }
}

pub const DIM: usize = 16;
pub const HIDDEN: usize = 32;
pub const BLOCKS: usize = 6;

/// A pre-norm MLP block: `x + fc2(gelu(fc1(norm(x))))`.
#[derive(Module, Debug)]
pub struct Block {
    pub norm: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Block {
    pub fn new(device: &Device) -> Self {
        Self {
            norm: LayerNormConfig::new(DIM).init(device),
            fc1: LinearConfig::new(DIM, HIDDEN).init(device),
            fc2: LinearConfig::new(HIDDEN, DIM).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.fc2.forward(gelu(self.fc1.forward(self.norm.forward(x.clone()))));
        x + h
    }
}

/// The layers outside the blocks.
#[derive(Module, Debug)]
pub struct Top {
    pub pre: Linear,
    pub post: Linear,
}

/// Six blocks between a pre and a post layer.
#[derive(Module, Debug)]
pub struct Model {
    pub pre: Linear,
    pub blocks: Vec<Block>,
    pub post: Linear,
}

impl Model {
    pub fn new(device: &Device) -> Self {
        device.seed(7);
        Self {
            pre: LinearConfig::new(DIM, DIM).init(device),
            blocks: (0..BLOCKS).map(|_| Block::new(device)).collect(),
            post: LinearConfig::new(DIM, DIM).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut x = self.pre.forward(x);
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.post.forward(x)
    }

    /// Splits into the top-level layers and the blocks.
    pub fn split(self) -> (Top, Vec<Block>) {
        (Top { pre: self.pre, post: self.post }, self.blocks)
    }
}

pub fn input(device: &Device) -> Tensor<2> {
    device.seed(11);
    Tensor::<2>::random([4, DIM], Distribution::Normal(0.0, 1.0), device)
}

pub fn max_abs_diff(a: &Tensor<2>, b: &Tensor<2>) -> f32 {
    let a = a.to_data().try_to_vec::<f32>().unwrap();
    let b = b.to_data().try_to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
