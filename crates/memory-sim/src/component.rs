//! Virtual components: byte sizes, activation profiles and FLOPs, moving and running on a simulated card.

use std::sync::Arc;

use offload_core::{ComponentError, DeviceLedger, DeviceName, Direction, Offloadable};

use crate::card::SimCard;

/// What a component holds on the card while and after it runs, beyond its weights.
///
/// A call's activations are a sequence of allocations, not one: [`allocations`](Self::allocations) equal
/// parts of the working set, made one after the other and all held until the call ends (a forward whose
/// activations build up layer after layer to its peak). On a full hard card the allocation that crosses the
/// card fails part-way through the call, and the parts made before it stay held until the manager has handled
/// the error, as a failed torch forward's tensors stay alive while its out-of-memory exception is handled: the
/// readings of an `oom_retry` row show them (a peak above the weights, less available than the weights alone
/// leave).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationProfile {
    /// Bytes held at the peak of a call, above the weights and everything held at entry (activations).
    pub working: u64,
    /// Bytes the call leaves behind (its outputs: embeddings, latents), held until the component's next call,
    /// which consumes them.
    pub left_behind: u64,
    /// How many allocations the working set is made in (at least 1); the last part takes the remainder.
    pub allocations: u32,
}

impl Default for ActivationProfile {
    fn default() -> Self {
        Self { working: 0, left_behind: 0, allocations: 1 }
    }
}

impl ActivationProfile {
    /// A working set made in one allocation, leaving `left_behind` bytes.
    pub fn new(working: u64, left_behind: u64) -> Self {
        Self { working, left_behind, allocations: 1 }
    }

    /// The same profile with the working set made in `allocations` parts (at least 1).
    pub fn in_allocations(self, allocations: u32) -> Self {
        Self { allocations: allocations.max(1), ..self }
    }

    /// The sizes of the working set's allocations, in the order they are made; they sum to the working set.
    pub fn parts(&self) -> impl Iterator<Item = u64> {
        let count = u64::from(self.allocations.max(1));
        let (part, rest) = (self.working / count, self.working % count);
        (0..count).map(move |i| if i + 1 == count { part + rest } else { part })
    }
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
/// its working set part by part (which can fail with out-of-memory in hard mode), pays compute time, frees it,
/// and leaves its outputs behind. A failed onload leaves it on the host with nothing allocated; a call that
/// fails part-way holds the parts it made until [`release_failed_call`](Offloadable::release_failed_call) (or
/// its next call).
#[derive(Debug)]
pub struct VirtualComponent {
    profile: ComponentProfile,
    card: Arc<SimCard>,
    device: DeviceName,
    held_outputs: u64,
    /// The parts of the working set a call that failed part-way made, still held.
    failed_call: u64,
    calls: u64,
}

impl VirtualComponent {
    /// A virtual component on the host.
    pub fn new(profile: ComponentProfile, card: Arc<SimCard>) -> Self {
        Self { profile, card, device: DeviceName::cpu(), held_outputs: 0, failed_call: 0, calls: 0 }
    }

    /// The profile it was built from.
    pub fn profile(&self) -> &ComponentProfile {
        &self.profile
    }

    /// How many calls completed.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Bytes a call that failed part-way still holds (0 once released).
    pub fn failed_call_bytes(&self) -> u64 {
        self.failed_call
    }

    /// One call: allocate the working set part by part, compute, free it, replace the held outputs. Returns
    /// the call's ordinal, a stand-in for its output. An allocation that fails leaves the parts made before it
    /// held (see [`failed_call_bytes`](Self::failed_call_bytes)).
    pub fn call(&mut self) -> Result<u64, ComponentError> {
        if self.device.is_cpu() {
            return Err(ComponentError::other(format!(
                "{} was called on the host; run it through the manager so it is onloaded first",
                self.profile.name
            )));
        }
        self.release_failed_call();
        // The previous call's outputs are this call's inputs: consumed here.
        self.card.free(self.held_outputs);
        self.held_outputs = 0;
        let ActivationProfile { working, left_behind, .. } = self.profile.activations;
        let mut made = 0;
        for part in self.profile.activations.parts() {
            if let Err(error) = self.card.allocate(part) {
                self.failed_call = made;
                return Err(error);
            }
            made += part;
        }
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

    fn release_failed_call(&mut self) {
        self.card.free(self.failed_call);
        self.failed_call = 0;
    }

    fn class_name(&self) -> String {
        format!("Virtual<{}>", self.profile.name)
    }
}
