//! Test doubles for the manager: the mock device (memory-sim's `SimCard`, hard, or soft with readings a test
//! sets) and a dummy model that allocates on it.

#![allow(dead_code)] // Each test file uses a different part of the doubles.

use std::sync::Arc;

use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{ComponentError, DeviceLedger, DeviceName};

/// The anchor's test unit: 1 KiB.
pub const UNIT: u64 = 1024;

/// A hard simulated card of `capacity` bytes (no context overhead, `cuda:0`): its readings follow its
/// allocations, and an allocation past the capacity fails with out-of-memory.
pub fn hard_card(capacity: u64) -> Arc<SimCard> {
    SimCard::new(
        CardSpec::parse(&capacity.to_string()).expect("a card size").with_mode(Mode::Hard).with_context_overhead(0),
    )
}

/// A soft simulated card of 80 units whose `available` reads `available` whatever is allocated (the anchor's
/// `_patch_memory_stats`; change it with `SimCard::patch_available`).
pub fn patched_card(available: u64) -> Arc<SimCard> {
    let card = SimCard::new(CardSpec::parse(&(80 * UNIT).to_string()).expect("a card size").with_context_overhead(0));
    card.patch_available(Some(available));
    card
}

/// The anchor's `DummyModel`: one weight of `bytes`, forward `x + sum(weight)`; its output takes `output` bytes
/// on the card while the run lasts, and `decode` is a second entry point.
pub struct Dummy {
    pub bytes: u64,
    pub weight_sum: f64,
    pub device: DeviceName,
    pub card: Arc<SimCard>,
    pub onloads: u64,
}

impl Dummy {
    /// A dummy of `bytes` on the host.
    pub fn new(bytes: u64, card: &Arc<SimCard>) -> Self {
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
