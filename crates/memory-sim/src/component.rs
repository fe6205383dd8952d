//! Virtual components: byte sizes, activation profiles and FLOPs, moving and running on a simulated card.

use std::sync::Arc;

use offload_core::{ComponentError, DeviceLedger, DeviceName, Direction, Offloadable};

use crate::card::SimCard;

/// What a component holds on the card while and after it runs, beyond its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActivationProfile {
    /// Bytes held at the peak of a call, above the weights and everything held at entry (activations).
    pub working: u64,
    /// Bytes the call leaves behind (its outputs: embeddings, latents), held until the component's next call,
    /// which consumes them.
    pub left_behind: u64,
}

/// The description of a virtual component: name, size, activations and work per call.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentProfile {
    /// The name it is added to the manager under.
    pub name: String,
    /// Weight bytes.
    pub bytes: u64,
    /// Activation profile of one call.
    pub activations: ActivationProfile,
    /// FLOPs of one call.
    pub flops: f64,
}

/// A component that exists only as numbers, moving and running on a [`SimCard`] through the real manager.
///
/// Onload allocates its bytes and pays the link; offload pays the link back and frees them; a call allocates
/// its working set (which can fail with out-of-memory in hard mode), pays compute time, frees it, and leaves its
/// outputs behind. A failed onload leaves it on the host with nothing allocated.
#[derive(Debug)]
pub struct VirtualComponent {
    profile: ComponentProfile,
    card: Arc<SimCard>,
    device: DeviceName,
    held_outputs: u64,
    calls: u64,
}

impl VirtualComponent {
    /// A virtual component on the host.
    pub fn new(profile: ComponentProfile, card: Arc<SimCard>) -> Self {
        Self { profile, card, device: DeviceName::cpu(), held_outputs: 0, calls: 0 }
    }

    /// The profile it was built from.
    pub fn profile(&self) -> &ComponentProfile {
        &self.profile
    }

    /// How many calls completed.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// One call: allocate the working set, compute, free it, replace the held outputs. Returns the call's
    /// ordinal, a stand-in for its output.
    pub fn call(&mut self) -> Result<u64, ComponentError> {
        if self.device.is_cpu() {
            return Err(ComponentError::other(format!(
                "{} was called on the host; run it through the manager so it is onloaded first",
                self.profile.name
            )));
        }
        // The previous call's outputs are this call's inputs: consumed here.
        self.card.free(self.held_outputs);
        self.held_outputs = 0;
        let ActivationProfile { working, left_behind } = self.profile.activations;
        self.card.allocate(working)?;
        self.card.compute(self.profile.flops);
        self.card.free(working);
        self.card.allocate(left_behind)?;
        self.held_outputs = left_behind;
        self.calls += 1;
        Ok(self.calls)
    }
}

impl Offloadable for VirtualComponent {
    fn bytes(&self) -> u64 {
        self.profile.bytes
    }

    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        self.card.allocate(self.profile.bytes)?;
        if let Err(error) = self.card.transfer(self.profile.bytes, Direction::HostToDevice) {
            self.card.free(self.profile.bytes);
            return Err(error);
        }
        self.device = device.clone();
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        // Like `module.to("cpu")` in the anchor, an offload copies the weights back across the link.
        self.card.transfer(self.profile.bytes, Direction::DeviceToHost)?;
        self.card.free(self.profile.bytes);
        self.device = DeviceName::cpu();
        Ok(())
    }

    fn class_name(&self) -> String {
        format!("Virtual<{}>", self.profile.name)
    }
}
